"""Token-by-token batching, shared by the stages that decode one token (or frame) per step: the
thinker (`thinker/causal_lm_adapter.py`) and the CSM talker (`talker/csm_adapter.py`).

Every request keeps its own KV cache; a step left-pads them into one temporary batch cache, an
attention mask hides the padding, and each row keeps its own position, so a request's tokens do
not depend on its batch mates. Sampling's nucleus (top-p) cut is shared too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

T = TypeVar("T")

#: One request's cache: each layer's keys and values [1, heads, tokens, dim].
KvLayers = list[tuple[torch.Tensor, torch.Tensor]]


def live(value: T | None, request_id: str) -> T:
    """A per-request value that the adapter's `release` clears."""
    if value is None:
        raise RuntimeError(f"request {request_id} was released")
    return value


def layer_kv(entry: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values [batch, heads, tokens, dim]."""
    if not isinstance(entry, DynamicLayer) or entry.keys is None or entry.values is None:
        raise RuntimeError("a cache layer is not an initialised dynamic layer")
    return entry.keys, entry.values


def left_pad(entries: torch.Tensor, length: int) -> torch.Tensor:
    """[batch, heads, tokens, dim] with zero entries in front, up to `length` tokens (the
    tensor itself when it has them already)."""
    missing = length - entries.shape[-2]
    if missing == 0:
        return entries
    zeros = entries.new_zeros((*entries.shape[:-2], missing, entries.shape[-1]))
    return torch.cat([zeros, entries], dim=-2)


def left_padded_cache(caches: Sequence[KvLayers], longest: int,
                      config: PretrainedConfig) -> DynamicCache:
    """The requests' caches as one batch cache (row i: caches[i]), each left-padded with zeros
    to `longest` tokens; an empty one when every cache is."""
    batch = DynamicCache(config=config)
    for layer in range(len(caches[0]) if longest else 0):
        keys, values = (_stacked([left_pad(cache[layer][part], longest) for cache in caches])
                        for part in (0, 1))
        batch.update(keys, values, layer)
    return batch


def padding_mask(lengths: Sequence[int], new: int) -> torch.Tensor:
    """The attention mask [rows, longest + new] of a left-padded batch: 0 on each row's
    padding, 1 on its cache entries and its `new` tokens."""
    longest = max(lengths)
    mask = torch.zeros((len(lengths), longest + new), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, longest - length:] = 1
    return mask


def nucleus(values: torch.Tensor, top_p: float, *, logits: bool) -> torch.Tensor:
    """Which tokens the top-p nucleus keeps, as a mask over `values` (probabilities, or logits
    when `logits`): the smallest set of most likely tokens whose mass reaches top_p, never
    empty (a token is kept while the mass of the more likely ones is below top_p)."""
    ordered, order = torch.sort(values, descending=True)
    probs = torch.softmax(ordered, dim=-1) if logits else ordered
    kept = torch.cumsum(probs, dim=-1) - probs < top_p
    return torch.zeros_like(kept).scatter(0, order, kept)


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows [1, ...] -> one batch [rows, ...]; a lone row as it is (no copy)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows)
