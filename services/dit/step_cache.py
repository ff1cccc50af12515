"""Per-row step caching for the DiT: each request's row decides, per CFG branch, whether a step
runs the whole transformer or reuses what the row cached.

Two methods, both keyed to the row (its `RowCache`, held in its state: freed on finish, abort
and failure, kept across preemption), never to the transformer call as diffusers' hooks are:

- `first_block` (First-Block-Cache, diffusers' `FirstBlockCacheConfig`): every row runs the
  first block; its residual (output - input) is compared with the one of the row's last full
  pass, `mean|r - r_prev| / mean|r_prev|`; at or under the row's threshold the row reuses its
  cached remainder (hidden after the last block - hidden after the first, from that full pass)
  and leaves the forward, the others run the remaining blocks as a smaller batch.
- `taylorseer` (diffusers' TaylorSeer in its lite form: only the transformer's output is
  forecast, so a row holds two output-sized tensors): on a fixed schedule a row skips the
  forward altogether and its output is the first-order Taylor forecast from its last two full
  passes.

Both compute the first `warmup_steps` and last `final_steps` steps of a row, and at most
`max_skips` reuses in a row (0: no limit). A Wan 2.2 row that switches transformer starts its
cache anew. Decisions are taken during a step's forwards but written to the rows only by
`CacheStep.commit`, once every forward of the step has returned: a step that raises (an
interrupt included) leaves every row's cache as it was. In a parallel group the residuals live
sharded on the ranks (services/dit/parallel_cache.py); rank 0's entries hold what decides.
"""

from __future__ import annotations

import enum
import itertools
import math
import os
import struct
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypedDict

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from stagemesh.services.dit.forward import Branch, RowHooks
from stagemesh.shared.engine.adapter import InvalidInputError

#: The request field that sets a row's threshold (0 = off for that request).
THRESHOLD_FIELD = "step_cache_threshold"
#: No option may raise a threshold above this: a relative change of 100% is no similarity.
THRESHOLD_CAP = 1.0
#: TaylorSeer's order (diffusers' default `max_order`): two output-sized tensors per branch.
TAYLOR_ORDER = 1
#: Cached rows may take at most this share of the memory free when the stage starts (the
#: forwards need the rest).
CACHE_MEMORY_SHARE = 0.5


class StepCacheMethod(enum.Enum):
    OFF = "off"
    FIRST_BLOCK = "first_block"
    TAYLORSEER = "taylorseer"


class StepCacheOptions(TypedDict, total=False):
    """The DiT's step-cache options (flat, published in Describe)."""

    #: off | first_block | taylorseer; YAML 1.1 reads a bare `off` as false, which means off
    step_cache: str | bool
    step_cache_threshold: float  # first_block: the relative change under which a row reuses
    step_cache_interval: int  # taylorseer: a full pass every this many steps
    step_cache_warmup_steps: int  # first steps always computed
    step_cache_final_steps: int  # last steps always computed
    step_cache_max_skips: int  # most reuses in a row; 0 = no limit
    max_step_cache_threshold: float  # the most a request may ask for


def as_float32(value: float) -> float:
    """`value` as a proto `float` field carries it. A request's threshold arrives so, the
    stage's settings are Python floats: compared as they are, a request for exactly the stage's
    maximum (0.2 -> 0.20000000298...) would be refused."""
    rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    return rounded


@dataclass(frozen=True)
class StepCacheConfig:
    """The stage's step-cache setting (its options, checked)."""

    method: StepCacheMethod = StepCacheMethod.OFF
    # `stagemesh bench cache_default` (docs/step-cache.md): the most reuse (58% of rows at 16
    # steps) keeping tiny-shapes' attributes within 2 points of off; diffusers' default, 0.05,
    # reused 0.5% there
    threshold: float = 0.2
    interval: int = 5  # diffusers' TaylorSeerCacheConfig default
    warmup_steps: int = 1
    final_steps: int = 1
    max_skips: int = 3
    max_threshold: float = 0.5

    @classmethod
    def from_options(cls, options: StepCacheOptions) -> StepCacheConfig:
        """The options, checked; a bad one raises ValueError naming it."""
        default = cls()
        name = options.get("step_cache", default.method.value)
        if name is False:
            name = StepCacheMethod.OFF.value
        methods = {method.value: method for method in StepCacheMethod}
        if name not in methods:
            raise ValueError(f"option step_cache must be one of {sorted(methods)}, got {name!r}")
        config = cls(
            method=methods[name],
            threshold=float(options.get("step_cache_threshold", default.threshold)),
            interval=options.get("step_cache_interval", default.interval),
            warmup_steps=options.get("step_cache_warmup_steps", default.warmup_steps),
            final_steps=options.get("step_cache_final_steps", default.final_steps),
            max_skips=options.get("step_cache_max_skips", default.max_skips),
            max_threshold=float(options.get("max_step_cache_threshold", default.max_threshold)),
        )
        config._check()
        return config

    def _check(self) -> None:
        if not 0 <= self.max_threshold <= THRESHOLD_CAP:
            raise ValueError(f"option max_step_cache_threshold must be in [0, {THRESHOLD_CAP}]")
        if not (math.isfinite(self.threshold) and 0 < self.threshold <= self.max_threshold):
            raise ValueError(
                "option step_cache_threshold must be in (0, max_step_cache_threshold="
                f"{self.max_threshold}], got {self.threshold}"
            )
        for name, value, least in (
            ("step_cache_interval", self.interval, 1),
            ("step_cache_warmup_steps", self.warmup_steps, 0),
            ("step_cache_final_steps", self.final_steps, 0),
            ("step_cache_max_skips", self.max_skips, 0),
        ):
            if value < least:
                raise ValueError(f"option {name} must be at least {least}, got {value}")

    @property
    def published_max_threshold(self) -> float:
        """The most a request may ask for: 0 on a stage without a cache."""
        return 0.0 if self.method is StepCacheMethod.OFF else self.max_threshold

    def request_threshold(self, asked: float | None) -> float:
        """The threshold a request runs at (0: its cache is off); None = the stage's setting.
        A taylorseer stage has one schedule: a request takes it (its threshold) or turns it off."""
        if asked is None:
            return 0.0 if self.method is StepCacheMethod.OFF else self.threshold
        if not (math.isfinite(asked) and asked >= 0):
            raise InvalidInputError(THRESHOLD_FIELD, f"{THRESHOLD_FIELD} must be >= 0, got {asked}")
        if asked == 0:
            return 0.0
        if as_float32(asked) > as_float32(self.published_max_threshold):
            raise InvalidInputError(
                THRESHOLD_FIELD,
                f"{THRESHOLD_FIELD} must be at most {self.published_max_threshold} on this stage "
                f"(step_cache={self.method.value}), got {asked}",
            )
        if (self.method is StepCacheMethod.TAYLORSEER
                and as_float32(asked) != as_float32(self.threshold)):
            raise InvalidInputError(
                THRESHOLD_FIELD,
                f"this stage's taylorseer cache takes {THRESHOLD_FIELD} 0 (off) or its own "
                f"{self.threshold}, got {asked}",
            )
        return self.threshold if self.method is StepCacheMethod.TAYLORSEER else asked

    def bytes_per_row(self, tokens: int, hidden_dim: int, output_elems: int, itemsize: int) -> int:
        """What a guided row (two branches) caches at most: first_block keeps two residuals of
        [tokens, hidden_dim] per branch, taylorseer TAYLOR_ORDER + 1 outputs per branch."""
        per_branch = {
            StepCacheMethod.OFF: 0,
            StepCacheMethod.FIRST_BLOCK: 2 * tokens * hidden_dim,
            StepCacheMethod.TAYLORSEER: (TAYLOR_ORDER + 1) * output_elems,
        }[self.method]
        return 2 * per_branch * itemsize


@dataclass(frozen=True)
class BranchCache:
    """What one branch of a row keeps from its last full pass (immutable: a step builds the
    next one, and `CacheStep.commit` puts it in place)."""

    model: int  # the transformer it came from (Wan 2.2: 0 or 1)
    computed_at: int  # the step of that full pass
    skips: int = 0  # reuses since
    head: torch.Tensor | None = None  # first_block: the first block's residual [tokens, dim]
    tail: torch.Tensor | None = None  # first_block: last block's hidden - first block's
    factors: tuple[torch.Tensor, ...] = ()  # taylorseer: output, then its divided differences

    def nbytes(self) -> int:
        tensors = [t for t in (self.head, self.tail, *self.factors) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


#: Every row cache's key, unique in the process (a group's ranks file its shards under it).
_KEYS = itertools.count()


@dataclass
class RowCache:
    """A request's cache: one entry per CFG branch. Part of the request's state."""

    threshold: float
    branches: dict[Branch, BranchCache] = field(default_factory=dict)
    key: int = field(default_factory=lambda: next(_KEYS))
    #: In a parallel group: tells the group that the request left (its ranks free its shards).
    on_free: Callable[[int], None] | None = None

    def nbytes(self) -> int:
        return sum(entry.nbytes() for entry in self.branches.values())


@dataclass
class Slot:
    """One row of one step: its cache (None: off), where it stands, and what the step decided."""

    cache: RowCache | None
    branch: Branch
    step: int
    total: int
    model: int = 0
    reused: bool = False
    next: BranchCache | None = None  # what commit puts in place

    @property
    def entry(self) -> BranchCache | None:
        """The branch's entry, if it came from this row's current transformer."""
        if self.cache is None:
            return None
        entry = self.cache.branches.get(self.branch)
        return entry if entry is not None and entry.model == self.model else None


_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()
_COUNTERS_LOCK = threading.Lock()


def rows_counter(registry: CollectorRegistry) -> Counter:
    """stagemesh_dit_rows_total{pass}: one family per registry, shared by its stages."""
    with _COUNTERS_LOCK:
        counter = _COUNTERS.get(registry)
        if counter is None:
            counter = Counter(
                "stagemesh_dit_rows_total",
                "DiT forward rows (request x CFG branch x step) by pass: full or reused",
                ["pass"],
                registry=registry,
            )
            _COUNTERS[registry] = counter
        return counter


class StepCache:
    """A DiT stage's step cache: its setting, and the accounting of what rows hold."""

    def __init__(self, config: StepCacheConfig, registry: CollectorRegistry = REGISTRY) -> None:
        self.config = config
        self._rows = rows_counter(registry)
        self._held = 0
        self._lock = threading.Lock()  # the compute thread writes, metrics and tests read

    @property
    def held_bytes(self) -> int:
        """Bytes every live row's cache holds (what release must bring back to 0)."""
        with self._lock:
            return self._held

    def new_row(self, threshold: float) -> RowCache | None:
        """A request's cache at `threshold` (`StepCacheConfig.request_threshold`); None: off."""
        return None if threshold == 0 else RowCache(threshold)

    def free(self, cache: RowCache | None) -> None:
        """Drop a row's cache (its request left the stage)."""
        if cache is None:
            return
        with self._lock:
            self._held -= cache.nbytes()
        cache.branches.clear()
        if cache.on_free is not None:
            cache.on_free(cache.key)

    def begin(self) -> CacheStep:
        return CacheStep(self)

    def _commit(self, slots: Sequence[Slot]) -> None:
        delta, reused = 0, 0
        for slot in slots:
            reused += slot.reused
            if slot.cache is None or slot.next is None:
                continue
            old = slot.cache.branches.get(slot.branch)
            delta += slot.next.nbytes() - (0 if old is None else old.nbytes())
            slot.cache.branches[slot.branch] = slot.next
        with self._lock:
            self._held += delta
        self._rows.labels("reused").inc(reused)
        self._rows.labels("full").inc(len(slots) - reused)


class CacheStep:
    """The decisions of one `step` call, written to the rows by `commit` alone."""

    def __init__(self, owner: StepCache) -> None:
        self._owner = owner
        self.config = owner.config
        self._slots: list[Slot] = []

    def slot(
        self, cache: RowCache | None, branch: Branch, step: int, total: int, model: int = 0
    ) -> Slot:
        slot = Slot(cache, branch, step, total, model)
        self._slots.append(slot)
        return slot

    def commit(self) -> None:
        self._owner._commit(self._slots)

    def _forced(self, slot: Slot) -> bool:
        """Whether the row must run its full pass whatever its similarity."""
        config, entry = self.config, slot.entry
        return (
            entry is None
            or slot.step < config.warmup_steps
            or slot.step >= slot.total - config.final_steps
            or 0 < config.max_skips <= entry.skips
        )

    # -- first_block ---------------------------------------------------------------------------

    def hooks(self, slots: Sequence[Slot]) -> FirstBlockHooks | None:
        """The first-block hooks of a forward over `slots`' rows; None when none caches."""
        if self.config.method is not StepCacheMethod.FIRST_BLOCK:
            return None
        if all(slot.cache is None for slot in slots):
            return None
        return FirstBlockHooks(self, list(slots))

    # -- taylorseer ----------------------------------------------------------------------------

    def forecasts(self, slots: Sequence[Slot]) -> dict[int, torch.Tensor]:
        """taylorseer: the rows (indices into `slots`) whose output is forecast, not computed."""
        if self.config.method is not StepCacheMethod.TAYLORSEER:
            return {}
        out: dict[int, torch.Tensor] = {}
        for i, slot in enumerate(slots):
            entry = slot.entry
            if entry is None or self._forced(slot) or self._on_schedule(slot.step):
                continue
            offset = slot.step - entry.computed_at
            forecast = torch.zeros_like(entry.factors[0])
            for order, factor in enumerate(entry.factors):
                forecast = forecast + factor * (offset**order / math.factorial(order))
            out[i] = forecast
            slot.reused = True
            slot.next = replace(entry, skips=entry.skips + 1)
        return out

    def _on_schedule(self, step: int) -> bool:
        """diffusers' TaylorSeer schedule: a full pass when (step - warmup - 1) % interval == 0."""
        return (step - self.config.warmup_steps - 1) % self.config.interval == 0

    def computed(self, slots: Sequence[Slot], outputs: torch.Tensor) -> None:
        """taylorseer: the rows of `slots` ran; `outputs` [rows, ...] renew their factors."""
        if self.config.method is not StepCacheMethod.TAYLORSEER:
            return
        for i, slot in enumerate(slots):
            if slot.cache is None:
                continue
            output, entry = outputs[i].clone(), slot.entry
            factors = [output]
            if entry is not None and TAYLOR_ORDER >= 1:
                delta = slot.step - entry.computed_at
                factors += [(output - entry.factors[0]) / delta]
            slot.next = BranchCache(slot.model, slot.step, factors=tuple(factors))


@dataclass(frozen=True)
class RowPlan:
    """One row's first-block cache as the ranks of a parallel group need it
    (services/dit/parallel_cache.py): rank 0 holds the row's entry, the ranks hold its residuals'
    shards and decide from them (`FirstBlockHooks.plans`, `settle`)."""

    key: int = -1  # the request's cache (`RowCache.key`); -1: the row caches nothing
    version: int = -1  # the step of the row's entry, whose shards the ranks hold; -1: none
    candidate: bool = False  # may reuse at this step (not forced to run in full)
    threshold: float = 0.0
    step: int = 0  # the version a full pass stores


class FirstBlockHooks:
    """First-Block-Cache over one forward's rows (`RowHooks`) on one device; in a group, what
    rank 0 plans and settles of the same rows."""

    def __init__(self, step: CacheStep, slots: list[Slot]) -> None:
        self._step = step
        self._slots = slots
        self._residuals: torch.Tensor | None = None

    def after_first_block(self, before: torch.Tensor, after: torch.Tensor) -> list[int]:
        residuals = after - before
        self._residuals = residuals
        step, slots = self._step, self._slots
        candidates = [
            i for i, s in enumerate(slots) if s.cache is not None and not step._forced(s)
        ]
        changes = _relative_changes(residuals, slots, candidates)
        for i, change in zip(candidates, changes, strict=True):
            slot = slots[i]
            cache = slot.cache
            if cache is not None and reuses(change, cache.threshold):
                slot.reused = True
        return [i for i, slot in enumerate(slots) if not slot.reused]

    def after_last_block(
        self, head: torch.Tensor, rows: list[int], tail: torch.Tensor | None
    ) -> torch.Tensor:
        residuals = self._residuals
        assert residuals is not None, "after_first_block runs first"
        if tail is not None:
            self._store(rows, residuals, tail - head[rows])
        reused = {}
        for i, slot in enumerate(self._slots):
            entry = slot.entry
            if not slot.reused or entry is None or entry.tail is None:
                continue
            reused[i] = entry.tail
            slot.next = _reused(entry)
        return assemble(head, rows, tail, reused)

    def _store(self, rows: list[int], heads: torch.Tensor, tails: torch.Tensor) -> None:
        """The rows that ran keep their residuals (copies: a view would hold the batch)."""
        for k, i in enumerate(rows):
            slot = self._slots[i]
            if slot.cache is not None:
                slot.next = BranchCache(
                    slot.model, slot.step, head=heads[i].clone(), tail=tails[k].clone()
                )

    # -- in a parallel group (rank 0) ----------------------------------------------------------

    def plans(self, on_free: Callable[[int], None]) -> list[RowPlan]:
        """What every rank needs of each row to decide as one device would; `on_free` is
        told each cached request's key when it leaves the stage (its shards are freed)."""
        plans = []
        for slot in self._slots:
            cache, entry = slot.cache, slot.entry
            if cache is None:
                plans.append(RowPlan(step=slot.step))
                continue
            cache.on_free = on_free
            version = -1 if entry is None else entry.computed_at
            plans.append(RowPlan(cache.key, version, not self._step._forced(slot),
                                 cache.threshold, slot.step))
        return plans

    def settle(self, reused: Sequence[bool]) -> None:
        """The group's decision for each row: a reuse counts against its entry, a full pass
        makes the step its entry (no tensors here: the ranks hold the residuals' shards)."""
        for slot, reuse in zip(self._slots, reused, strict=True):
            entry = slot.entry
            if slot.cache is None:
                continue
            if reuse:
                assert entry is not None, "only a row with an entry may reuse"
                slot.reused = True
                slot.next = _reused(entry)
            else:
                slot.next = BranchCache(slot.model, slot.step)


def _reused(entry: BranchCache) -> BranchCache:
    return replace(entry, skips=entry.skips + 1)


def reuses(change: float, threshold: float) -> bool:
    """First-Block-Cache's rule: a row reuses when its relative change is within its
    threshold."""
    return change <= threshold


def assemble(
    head: torch.Tensor, rows: list[int], tail: torch.Tensor | None,
    reused: Mapping[int, torch.Tensor],
) -> torch.Tensor:
    """Every row's hidden states after the last block: `tail` holds those of `rows` (which
    ran), `reused` the cached remainder of the others, added to their head block's output
    (diffusers' order: cached residual + head output)."""
    if len(rows) == head.shape[0] and tail is not None:
        return tail
    out = torch.empty_like(head)
    if tail is not None:
        out[rows] = tail
    for i, remainder in reused.items():
        out[i] = remainder + head[i]
    return out


def change_terms(residual: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[mean|r - r_prev|, mean|r_prev|] of one row: over equal shards of its tokens, the
    terms' sums have the same ratio (a group all-reduces them)."""
    return torch.stack([(residual - previous).abs().mean(), previous.abs().mean()])


def relative_changes(terms: torch.Tensor) -> list[float]:
    """Each row's relative change from its `change_terms` [rows, 2] (one device sync)."""
    values: list[float] = (terms[:, 0] / terms[:, 1]).tolist()
    return values


def _relative_changes(
    residuals: torch.Tensor, slots: Sequence[Slot], rows: Sequence[int]
) -> list[float]:
    """mean|r - r_prev| / mean|r_prev| of each of `rows` against its last full pass."""
    if not rows:
        return []
    terms = []
    for i in rows:
        entry = slots[i].entry
        assert entry is not None and entry.head is not None, "a forced row is no candidate"
        terms.append(change_terms(residuals[i], entry.head))
    return relative_changes(torch.stack(terms))


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on `device` now: the accelerator's, or the host's available pages."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_capacity(bytes_per_row: int, max_running: int, device: torch.device) -> None:
    """Every running request may hold a cached row: `max_running` of them must fit in
    CACHE_MEMORY_SHARE of the memory free now, or the stage refuses to start."""
    if bytes_per_row == 0:
        return
    budget = int(free_memory_bytes(device) * CACHE_MEMORY_SHARE)
    if max_running * bytes_per_row > budget:
        raise ValueError(
            f"option max_running={max_running} x {bytes_per_row} bytes per cached row (at the "
            f"largest size the stage accepts) is more than {budget} bytes "
            f"({CACHE_MEMORY_SHARE:.0%} of the free {device.type} memory): lower max_running "
            "or the size limits, or run step_cache=off"
        )


def forward_rows(
    step: CacheStep,
    slots: Sequence[Slot],
    forward: Callable[[list[int], RowHooks | None], torch.Tensor],
) -> list[torch.Tensor]:
    """Each row's transformer output [1, ...]: forecast (taylorseer) or from one forward over
    the other rows, `forward(rows, hooks)` (first_block hooks may reuse rows inside it)."""
    outputs = {i: forecast.unsqueeze(0) for i, forecast in step.forecasts(slots).items()}
    run = [i for i in range(len(slots)) if i not in outputs]
    if run:
        ran = [slots[i] for i in run]
        output = forward(run, step.hooks(ran))
        step.computed(ran, output)
        outputs |= {i: output[k : k + 1] for k, i in enumerate(run)}
    return [outputs[i] for i in range(len(slots))]
