"""The first-block step cache inside a DiT group (services/dit/parallel.py).

Rank 0 owns every request's cache as on one device (its `RowCache` in the request's state: the
step each branch's entry was computed at, its reuses; step_cache.py decides which rows may
reuse, and commits at the end of the step). What rank 0 cannot hold are the residuals: under
Ulysses each rank holds its share of a row's tokens, under CFG-parallel a request's
unconditional row runs on other ranks than its conditional row. So every forward carries, per
row, a `step_cache.RowPlan` (the request's cache key, the version of the row's entry, whether it
may reuse, its threshold, the step a full pass stores as) and the keys of the requests that left
since the last forward (finished, cancelled, failed: their shards are freed). Each rank:

- keeps its shards in a `ShardStore`, by (cache key, branch): the version rank 0 committed,
  plus the one a forward computes. A version rank 0 did not commit (its step raised after the
  forward) is dropped by the next forward that names the row, as one device drops `slot.next`;
- after the first block computes, per row that may reuse, the two terms of its relative change
  on its shard (`step_cache.change_terms`), all-reduces them over the ranks that share the
  row's tokens and decides by step_cache's rule: those ranks take the same decision, and it is
  one device's (a mean over equal shards is the mean of the shards' means; each branch is a
  row of its own, as on one device, so a request's two branches never need to agree);
- reports its decisions with its output (the other CFG half's leader sends them to rank 0),
  and rank 0 settles the rows' entries (`FirstBlockHooks.settle`).

A CFG half whose rows all reuse skips the remaining blocks but still takes their interrupt
votes, which every rank takes block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import EquipartitionSharder
from torch.distributed.device_mesh import DeviceMesh

from stagemesh.services.dit.forward import Branch
from stagemesh.services.dit.step_cache import (
    RowPlan,
    assemble,
    change_terms,
    relative_changes,
    reuses,
)

#: A row's shards: its request's cache key and its branch.
ShardKey = tuple[int, Branch]


@dataclass(frozen=True)
class Shards:
    """This rank's share of a row's cached residuals (its tokens, under Ulysses)."""

    head: torch.Tensor  # the first block's residual
    tail: torch.Tensor  # hidden after the last block - after the first

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.head, self.tail))


class ShardStore:
    """A rank's shards of the rows it runs, by row and version (the step they were computed
    at); what rank 0's step cache holds of the same rows is their entries' metadata."""

    def __init__(self) -> None:
        self._rows: dict[ShardKey, dict[int, Shards]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def nbytes(self) -> int:
        return sum(s.nbytes() for versions in self._rows.values() for s in versions.values())

    def free(self, keys: Iterable[int]) -> None:
        """Drop every shard of the requests `keys` (they left the stage)."""
        gone = set(keys)
        for row in [row for row in self._rows if row[0] in gone]:
            del self._rows[row]

    def keep(self, row: ShardKey, version: int) -> Shards | None:
        """The row's shards of `version` (-1: none); every other version is dropped."""
        kept = self._rows.get(row, {}).get(version)
        if kept is None:
            self._rows.pop(row, None)
            return None
        self._rows[row] = {version: kept}
        return kept

    def put(self, row: ShardKey, version: int, shards: Shards) -> None:
        self._rows.setdefault(row, {})[version] = shards


def plans_to_tensors(plans: Sequence[RowPlan],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' plans as a broadcast carries them: int64 [rows, 4] (key, version, candidate,
    step) and float64 [rows] (thresholds: exact for any float a request sets)."""
    ints = torch.tensor([[p.key, p.version, int(p.candidate), p.step] for p in plans],
                        dtype=torch.int64, device=device).reshape(len(plans), 4)
    thresholds = torch.tensor([p.threshold for p in plans], dtype=torch.float64, device=device)
    return ints, thresholds


def plans_from_tensors(ints: torch.Tensor, thresholds: torch.Tensor) -> tuple[RowPlan, ...]:
    return tuple(RowPlan(key, version, bool(candidate), threshold, step)
                 for (key, version, candidate, step), threshold
                 in zip(ints.tolist(), thresholds.tolist(), strict=True))


class ShardedFirstBlock:
    """First-Block-Cache over one rank's rows of a group forward (`RowHooks`): `plans` and
    `branches` are those rows'; `tokens` is the mesh of the ranks that share their tokens
    (None: this rank holds them whole); `skip` takes the interrupt votes of the blocks after
    the first when every row reuses."""

    def __init__(self, plans: Sequence[RowPlan], branches: Sequence[Branch], store: ShardStore,
                 tokens: DeviceMesh | None, skip: Callable[[], None]) -> None:
        self._plans = plans
        self._rows: list[ShardKey] = [(plan.key, branch)
                                      for plan, branch in zip(plans, branches, strict=True)]
        self._store = store
        self._tokens = tokens
        self._skip = skip
        self._residuals: torch.Tensor | None = None
        self._kept: dict[int, Shards] = {}
        #: Each row's decision, the same on every rank that shares its tokens.
        self.reused = [False] * len(plans)

    def after_first_block(self, before: torch.Tensor, after: torch.Tensor) -> list[int]:
        if self._tokens is not None and before.shape[1] != after.shape[1]:
            # the first block's input is split as diffusers' context parallelism splits it
            before = EquipartitionSharder.shard(before, 1, self._tokens)
        residuals = self._residuals = after - before
        for i, plan in enumerate(self._plans):
            if plan.key >= 0 and (kept := self._store.keep(self._rows[i], plan.version)):
                self._kept[i] = kept
        candidates = [i for i, plan in enumerate(self._plans) if plan.candidate]
        if missing := [i for i in candidates if i not in self._kept]:
            raise RuntimeError(f"rows {missing} may reuse, but this rank holds no shards of "
                               "their entries")
        if candidates:
            terms = torch.stack([change_terms(residuals[i], self._kept[i].head)
                                 for i in candidates])
            if self._tokens is not None:
                dist.all_reduce(terms, group=self._tokens.get_group())
            for i, change in zip(candidates, relative_changes(terms), strict=True):
                self.reused[i] = reuses(change, self._plans[i].threshold)
        return [i for i, reused in enumerate(self.reused) if not reused]

    def after_last_block(self, head: torch.Tensor, rows: list[int],
                         tail: torch.Tensor | None) -> torch.Tensor:
        residuals = self._residuals
        assert residuals is not None, "after_first_block runs first"
        if tail is None:
            self._skip()
        else:
            for k, i in enumerate(rows):
                plan = self._plans[i]
                if plan.key >= 0:  # copies: a view would hold the batch
                    shards = Shards(residuals[i].clone(), (tail[k] - head[i]).clone())
                    self._store.put(self._rows[i], plan.step, shards)
        reused = {i: self._kept[i].tail for i, reused in enumerate(self.reused) if reused}
        return assemble(head, rows, tail, reused)
