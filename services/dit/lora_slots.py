"""The per-row LoRA product: slot stacks on the transformer's Linears, and who holds which slot.

Every Linear some adapter of the catalog targets gets, beside its base weight (never merged,
never swapped), a down stack A [max_loras + 1, max_lora_rank, in] and an up stack
B' [max_loras + 1, max_lora_rank, out] (B transposed, so both gather as [k * rank, features])
of zeros; the last slot stays zero, and is what a row without an adapter (or with fewer than its
batch mates) points at, so that no loaded slot ever enters its product. An adapter loaded into
slot s writes its matrices into A[s] and B'[s] (rank padded with zeros, PEFT's per-module
alpha/r folded into B), so that a forward hook adds, per row b with adapters (s_k, w_k):

    y[b] += sum_k w_k * B[s_k] @ A[s_k] @ x[b]

as two batched matmuls over the gathered slots (Punica's BGMV). Rows with other adapters,
several adapters, other scales or none (scale 0) share the forward; a batch without any
adapter adds nothing, so it is bit for bit the base model. When every row runs the same
adapters at the same scales (one adapter for the whole batch, the common case) the rows are
one group: the slots are gathered once and the product is two plain matmuls over all tokens.
The stacks are cut to the largest rank the bound rows use (the padding would add zeros only).
Which slots and scales each row runs is bound for one forward (`bind`, from the rows'
`RowMeta.adapters`) and narrowed with the rows that run a block subset (`narrowed`, the step
cache's), so the product follows forward.py's row records (ARCHITECTURE §10).

Slots are held by requests (`hold` in prepare, `release` with the state): a held slot is never
evicted, so a running or preempted row keeps its adapters; a free slot is taken LRU. Files are
read on a loader thread and written into their slots on the engine thread at a step boundary
(`attach`); a request whose adapters are not attached yet (loading, or every slot it could
take is held) waits while the others step.

`SlotStacks` holds the stacks and the binding; `SlotBank` (one per DiT stage) adds the holders
and the loading. A parallel group's workers hold only a `SlotStacks`, which rank 0 keeps equal
to its bank's (services/dit/parallel.py).

Runtime updates (services/dit/lora_updates.py) change the catalog, never the slots: a hold
names the files its request resolved in prepare, slots are keyed by file, and a withdrawn
file's slot is freed at the first boundary where no row holds it. A file that targets Linears
without stacks yet gets them there too (zeros for every other slot).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin
from peft.utils.other import get_pattern_key

from stagemesh.services.dit.forward import RowMeta, SlotUse
from stagemesh.services.dit.lora import DOWN, UP, AdapterFile, LoraCatalog, LoraUse
from stagemesh.shared.engine.adapter import NoStream, StepOutput

logger = logging.getLogger(__name__)


#: The longest a step whose every state waits for its adapters blocks the engine thread.
WAIT_SECONDS = 0.05

#: An adapter's (A, B * alpha / r) per target module.
Matrices = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class LoraHold:
    """A request's adapters, and (once attached) their slots and scales: held until release."""

    uses: tuple[LoraUse, ...]
    files: tuple[AdapterFile, ...] = ()  # what `uses` named when the request was prepared
    slots: tuple[SlotUse, ...] | None = None  # None: waiting for a load or a slot
    error: str | None = None  # an adapter file could not be read: the request fails

    @property
    def attached(self) -> bool:
        return self.slots is not None or not self.uses


#: A diffusers pipeline's `lora_state_dict` (its LoRA loader mixin's classmethod).
LoraFiles = Callable[..., Any]


class Holding(Protocol):
    """A DiT state as `step_attached` sees it."""

    @property
    def step_index(self) -> int: ...

    @property
    def lora(self) -> LoraHold | None: ...


HoldingT = TypeVar("HoldingT", bound=Holding)
#: What a step streams besides its index (a DiT's preview); a waiting state streams nothing.
PartialT = TypeVar("PartialT")


@dataclass
class _Rows:
    """What the rows a forward runs now add: per group of rows (every row, or one group for
    all when they run the same adapters at the same scales) its slots [groups, k] and each
    slot's scale on its rank columns [groups, 1, k * rank]; `rank` cuts the stacks."""

    slots: torch.Tensor
    scales: torch.Tensor
    rank: int

    def select(self, rows: torch.Tensor) -> _Rows:
        if self.slots.shape[0] == 1:  # one group: any subset of its rows is too
            return self
        return _Rows(self.slots[rows], self.scales[rows], self.rank)


class _Stacks:
    """One LoRA'd Linear's slot stacks, applied by a forward hook while rows are bound."""

    def __init__(self, bank: SlotStacks, linear: torch.nn.Linear) -> None:
        self.bank = bank
        shape = (bank.max_loras + 1, bank.max_rank)
        weight = linear.weight
        self.down = torch.zeros(*shape, linear.in_features, device=weight.device, dtype=bank.dtype)
        self.up = torch.zeros(*shape, linear.out_features, device=weight.device, dtype=bank.dtype)

    def hook(
        self, module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:
        rows = self.bank.rows
        if rows is None:
            return out
        x = args[0]
        groups = rows.slots.shape[0]
        flat = x.reshape(groups, -1, x.shape[-1])  # [groups, tokens of the group, in]
        down = self.down[:, : rows.rank][rows.slots].flatten(1, 2)  # [groups, k * rank, in]
        up = self.up[:, : rows.rank][rows.slots].flatten(1, 2)  # [groups, k * rank, out]
        low = torch.bmm(flat, down.transpose(1, 2)).mul_(rows.scales)
        delta = torch.bmm(low, up).reshape(out.shape)
        return out + delta.to(out.dtype)


class SlotStacks:
    """`max_loras` slots on LoRA'd Linears of the transformers, and which rows run which slots
    in a forward (`bind`, `narrowed`). What is in a slot is written by `write_slot`; a
    `SlotBank` decides that. A group's worker rank holds one of these alone, mirroring rank 0's
    (services/dit/parallel.py): the Linears are named by (transformer index, module name)."""

    def __init__(self, transformers: Sequence[torch.nn.Module], max_loras: int,
                 max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype = next(transformers[0].parameters()).dtype
        self.device = next(transformers[0].parameters()).device
        self.rows: _Rows | None = None
        #: (transformer index, module name, its stacks), in the order they were added
        self.stacks: list[tuple[int, str, _Stacks]] = []
        self._modules = [dict(transformer.named_modules()) for transformer in transformers]
        self._stacked: set[str] = set()
        self._ranks: dict[int, int] = {}  # slot -> the largest rank written into it
        #: slots written since `take_written` (what a group's rank 0 sends its workers)
        self._written: set[int] = set()

    def check_targets(self, targets: frozenset[str]) -> None:
        """ValueError unless every target is a Linear of every transformer."""
        for modules in self._modules:
            for name in sorted(targets):
                if not isinstance(modules.get(name), torch.nn.Linear):
                    raise ValueError(f"LoRA target {name!r} is not a Linear of the transformer")

    def _add_stacks(self, targets: frozenset[str]) -> None:
        """Zero stacks and a forward hook on every target without them yet (engine thread,
        between forwards: a hook must not be added to a module while it runs)."""
        new = targets - self._stacked
        self.check_targets(new)
        self.add_stacks([(model, name) for model in range(len(self._modules))
                         for name in sorted(new)])
        self._stacked |= new

    def add_stacks(self, linears: Sequence[tuple[int, str]]) -> None:
        """Zero stacks and a forward hook on each (transformer index, module name), in order."""
        for model, name in linears:
            linear = self._modules[model][name]
            assert isinstance(linear, torch.nn.Linear)
            stacks = _Stacks(self, linear)
            self.stacks.append((model, name, stacks))
            linear.register_forward_hook(stacks.hook)

    @torch.no_grad()
    def write_slot(self, slot: int, rank: int,
                   pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` of every stack, in `stacks` order: its (A, B) pair (any rank up to
        `max_rank`), or zeros (None: the adapter targets nothing there); `rank` is the
        largest rank written."""
        for (_, _, stacks), pair in zip(self.stacks, pairs, strict=True):
            stacks.down[slot].zero_()
            stacks.up[slot].zero_()
            if pair is not None:
                down, up = pair
                stacks.down[slot, : down.shape[0]] = down.to(self.device, self.dtype)
                stacks.up[slot, : down.shape[0]] = up.T.to(self.device, self.dtype)
        self._ranks[slot] = rank
        self._written.add(slot)

    def take_written(self) -> list[int]:
        """The slots written since the last call, in slot order."""
        written, self._written = sorted(self._written), set()
        return written

    def slot_rank(self, slot: int) -> int:
        return self._ranks.get(slot, 1)

    # -- one forward -----------------------------------------------------------------------

    @contextmanager
    def bind(self, rows: Sequence[RowMeta]) -> Iterator[None]:
        """The rows' slots and scales for one forward; nothing added when no row has any."""
        width = max((len(row.adapters) for row in rows), default=0)
        if not width:
            yield
            return
        groups = [row.adapters for row in rows]
        if all(adapters == groups[0] for adapters in groups):
            groups = groups[:1]  # one group: the slots gathered once for every row
        rank = max(self.slot_rank(use.slot) for row in groups for use in row)
        slots = torch.full((len(groups), width), self.max_loras, dtype=torch.long)  # zero slot
        scales = torch.zeros(len(groups), width, dtype=torch.float32)
        for i, adapters in enumerate(groups):
            for k, use in enumerate(adapters):
                slots[i, k], scales[i, k] = use.slot, use.scale
        columns = scales.repeat_interleave(rank, dim=1)[:, None]  # [groups, 1, k * rank]
        self.rows = _Rows(slots.to(self.device), columns.to(self.device, self.dtype), rank)
        try:
            yield
        finally:
            self.rows = None

    @contextmanager
    def narrowed(self, rows: torch.Tensor) -> Iterator[None]:
        """Only `rows` (indices into the bound rows) run until the block returns."""
        bound = self.rows
        if bound is None:
            yield
            return
        self.rows = bound.select(rows)
        try:
            yield
        finally:
            self.rows = bound


class SlotBank(SlotStacks):
    """The slots of every Linear the catalog's adapters target, and their holders."""

    def __init__(
        self,
        transformers: Sequence[torch.nn.Module],
        catalog: LoraCatalog,
        files: LoraFiles = QwenImageLoraLoaderMixin.lora_state_dict,
    ) -> None:
        """transformers: each gets the slots (Wan 2.2: both, as diffusers'
        `load_into_transformer_2`); files: the pipeline's `lora_state_dict` (it converts the
        layouts that pipeline's LoRAs come in)."""
        config = catalog.config
        super().__init__(transformers, config.max_loras, config.max_lora_rank)
        self.catalog, self.files = catalog, files
        self._add_stacks(catalog.targets())
        self._loaded: OrderedDict[AdapterFile, int] = OrderedDict()  # least recent first
        self._holders: dict[int, int] = {}  # slot -> requests holding it
        self._pending: list[LoraHold] = []  # oldest first
        self._loading: dict[AdapterFile, futures.Future[Matrices]] = {}
        # Files are read off the engine thread; one reader keeps disk and host memory calm.
        self._loader = futures.ThreadPoolExecutor(1, thread_name_prefix="lora-loader")

    # -- holding ---------------------------------------------------------------------------

    def hold(self, uses: Sequence[LoraUse]) -> LoraHold:
        """A request's claim on its adapters' slots (made in prepare). The files of those not
        resident start loading on the loader thread now; the hold is attached (`attach`, at a
        step boundary) once every one is loaded and has a slot."""
        hold = LoraHold(tuple(uses), self.catalog.resolve(uses))
        if uses:
            self._pending.append(hold)
            for adapter in hold.files:
                self._load(adapter)
            self.attach()
        return hold

    def attach(self) -> None:
        """Attach every pending hold that can be (oldest first; one that cannot waits while the
        others pass): its missing adapters are written into free or least recently used unheld
        slots. Engine thread only, between forwards (the slot stacks are what they read)."""
        self._free_withdrawn()
        for hold in list(self._pending):
            missing = [f for f in hold.files if f not in self._loaded]
            for adapter in missing:  # evicted since it was held: read it again
                self._load(adapter)
            loads = [self._loading[adapter] for adapter in missing]
            if not all(load.done() for load in loads):
                continue
            failed = next((load.exception() for load in loads if load.exception()), None)
            if failed is not None:  # this request fails; the file is read again if named again
                self._fail(hold, missing, failed)
                continue
            evictable = [f for f, s in self._loaded.items() if s not in self._holders]
            free = self.max_loras - len(self._loaded)
            mine = set(hold.files)
            if len(missing) > free + len([f for f in evictable if f not in mine]):
                continue  # every slot it could take is held: it waits
            try:
                for adapter in missing:
                    matrices = self._loading.pop(adapter).result()
                    self._write(self._free_slot(keep=mine), adapter, matrices)
            except (RuntimeError, ValueError) as exc:  # new stacks: out of memory, a bad target
                self._fail(hold, missing, exc)
                continue
            self._pending.remove(hold)
            slots = []
            for use, adapter in zip(hold.uses, hold.files, strict=True):
                self._loaded.move_to_end(adapter)
                slot = self._loaded[adapter]
                self._holders[slot] = self._holders.get(slot, 0) + 1
                slots.append(SlotUse(slot, use.scale))
            hold.slots = tuple(slots)

    def _fail(self, hold: LoraHold, missing: list[AdapterFile], error: BaseException) -> None:
        """The hold's request fails (a file is read again if named again)."""
        self._pending.remove(hold)
        for adapter in missing:
            self._loading.pop(adapter, None)
        hold.error = f"lora: {error}"

    def _free_withdrawn(self) -> None:
        """Free the slots of files unloaded (or replaced) at run time that no row holds or
        waits for any more: the deferred half of an unload."""
        wanted = {adapter for hold in self._pending for adapter in hold.files}
        for adapter, slot in list(self._loaded.items()):
            if slot not in self._holders and adapter not in wanted and not (
                self.catalog.current(adapter)
            ):
                del self._loaded[adapter]
                logger.info("LoRA %s unloaded from slot %d", adapter.name, slot)

    def wait(self, timeout: float) -> None:
        """Until some pending hold's file has loaded, or `timeout` seconds (nothing to attach
        this tick: a short wait instead of a spinning engine)."""
        loads = [self._loading[f] for h in self._pending for f in h.files
                 if f in self._loading]  # fmt: skip
        if loads:
            futures.wait(loads, timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def release(self, hold: LoraHold | None) -> None:
        """The request's slots are free to evict (or its pending claim is dropped)."""
        if hold is None:
            return
        if hold in self._pending:
            self._pending.remove(hold)
            wanted = {f for h in self._pending for f in h.files}
            for adapter in hold.files:
                if adapter not in wanted and adapter in self._loading:
                    self._loading.pop(adapter).cancel()
        for held in hold.slots or ():
            self._holders[held.slot] -= 1
            if not self._holders[held.slot]:
                del self._holders[held.slot]
        hold.slots = None

    def held(self, slot: int) -> bool:
        return slot in self._holders

    def resident(self) -> list[str]:
        """The loaded adapters' names, least recently used first."""
        return [adapter.name for adapter in self._loaded]

    def _load(self, adapter: AdapterFile) -> None:
        if adapter not in self._loaded and adapter not in self._loading:
            self._loading[adapter] = self._loader.submit(read_adapter, adapter, self.files)

    def _free_slot(self, keep: set[AdapterFile]) -> int:
        used = set(self._loaded.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(
            f for f, s in self._loaded.items() if s not in self._holders and f not in keep
        )
        logger.info("LoRA %s evicted", victim.name)
        return self._loaded.pop(victim)

    def step_attached(
        self,
        states: Sequence[HoldingT],
        step: Callable[[Sequence[HoldingT]], list[StepOutput[PartialT]]],
    ) -> list[StepOutput[PartialT]]:
        """`step` over the states whose adapters are attached (pending holds attached first);
        each other state waits, its output repeating its step index."""
        self.attach()
        ready = [state for state in states if state.lora is None or state.lora.attached]
        if not ready:
            self.wait(WAIT_SECONDS)
        stepped = iter(step(ready) if ready else [])
        chosen = {id(state) for state in ready}
        outputs: list[StepOutput[PartialT]] = [
            next(stepped) if id(state) in chosen else _waiting(state) for state in states]
        return outputs

    # -- loading ---------------------------------------------------------------------------

    def _write(self, slot: int, adapter: AdapterFile, matrices: Matrices) -> None:
        """The adapter's matrices into `slot` of every stack (zeros where it targets nothing)."""
        self._add_stacks(frozenset(matrices))
        self.write_slot(
            slot, max((down.shape[0] for down, _ in matrices.values()), default=1),
            [matrices.get(name) for _, name, _ in self.stacks])
        self._loaded[adapter] = slot
        logger.info("LoRA %s loaded into slot %d", adapter.name, slot)


def _waiting(state: Holding) -> StepOutput[NoStream]:
    """A state whose adapters are not attached: it waits, or fails if one could not load."""
    error = state.lora.error if state.lora is not None else None
    return StepOutput(step_index=state.step_index, error=error)


def read_adapter(adapter: AdapterFile, files: LoraFiles) -> Matrices:
    """The adapter's (A, B * alpha / r) per target module, read through diffusers'
    `lora_state_dict` (which converts non-diffusers layouts), scaled as PEFT's LoraConfig
    from the file's metadata scales them (no metadata: alpha = rank, scale 1)."""
    state, metadata = files(
        str(adapter.path.parent), weight_name=adapter.path.name, return_lora_metadata=True
    )
    config = {key.removeprefix("transformer."): value for key, value in (metadata or {}).items()}
    if config.get("use_dora") or any("lora_magnitude_vector" in k for k in state):
        raise ValueError(f"LoRA {adapter.name}: DoRA is not served")
    alpha_pattern: dict[str, float] = config.get("alpha_pattern") or {}
    matrices: Matrices = {}
    for key, down in state.items():
        if DOWN not in key:
            continue
        module = key.split(DOWN)[0]
        name = module.removeprefix("transformer.")
        rank = down.shape[0]  # PEFT's rank_pattern names exactly this
        alpha = float(config.get("lora_alpha", rank))
        if alpha_pattern:
            alpha = float(alpha_pattern.get(get_pattern_key(list(alpha_pattern), name), alpha))
        scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
        up = state[module + UP + "weight"] * scaling
        if not (torch.isfinite(down).all() and torch.isfinite(up).all()):
            raise ValueError(f"LoRA {adapter.name}: {name} holds non-finite weights")
        matrices[name] = (down, up)
    return matrices
