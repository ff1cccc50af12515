"""The thinker's prefix cache: the KV caches of recent conversations, so that a prompt which
begins like one of them prefills only the rest.

A conversation's next turn repeats everything before it: the chat template's system prompt,
the earlier questions and answers. Like vLLM's automatic prefix caching (per conversation here,
not per block), the stage keeps, per recent request, the tokens it fed and their keys and
values; a new prompt takes the longest common token prefix with any of them and feeds the
model only what follows (at least its last token, whose logits choose the first answer token).
A prompt is kept after its prefill, and a finished answer with its prompt, so the next turn of
a spoken conversation prefills its new question only. Nothing is shared between requests but
read-only tensors: a forward appends to a copy (`torch.cat`), never to a kept cache.

Bounded by tokens (`max_tokens`, the stage option `prefix_cache_tokens`; 0 = off): the least
recently used entries go first. A hit changes only how the prompt's keys and values were
computed (in two passes instead of one): greedy answers equal a cold prefill's up to float
rounding (tests/model/test_thinker_adapter.py checks the bench's questions).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from stagemesh.services.kv_batching import KvLayers

#: Tokens of keys and values kept by default (SmolLM2-135M: 45 KiB a token, so ~180 MiB).
DEFAULT_PREFIX_CACHE_TOKENS = 4096


class PrefixCache:
    """Token sequences and their KV caches, least recently used first."""

    def __init__(self, max_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], KvLayers] = (
            collections.OrderedDict())
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens held, all entries together."""
        return self._tokens

    def longest(self, prompt: Sequence[int]) -> tuple[int, KvLayers]:
        """The longest kept prefix of `prompt`, shorter than it (its last token must be fed),
        and its keys and values (views of the kept ones); (0, []) when none matches."""
        best, best_key = 0, None
        for key in self._entries:
            shared = _common_prefix(key, prompt, len(prompt) - 1)
            if shared > best:
                best, best_key = shared, key
        if best_key is None:
            return 0, []
        self._entries.move_to_end(best_key)
        layers = self._entries[best_key]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers]

    def keep(self, tokens: Sequence[int], layers: KvLayers) -> None:
        """Keep `tokens` and their keys and values (copied: a batch's views would hold the
        whole batch); an entry that is a prefix of them is replaced, and nothing is added
        when a kept entry already starts with them."""
        key = tuple(tokens)
        if not key or len(key) > self.max_tokens:
            return
        for kept in list(self._entries):
            if kept[: len(key)] == key:
                self._entries.move_to_end(kept)
                return
            if key[: len(kept)] == kept:
                self._drop(kept)
        length = len(key)
        self._entries[key] = [(k[:, :, :length].clone(), v[:, :, :length].clone())
                              for k, v in layers]
        self._tokens += length
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self._tokens -= len(key)


def _common_prefix(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """How many leading tokens `a` and `b` share, at most `most`."""
    shared = 0
    for x, y in zip(a, b, strict=False):
        if shared >= most or x != y:
            break
        shared += 1
    return shared
