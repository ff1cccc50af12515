"""One DiT over several ranks: CFG-parallel and Ulysses sequence-parallel stage groups.

A group is one gRPC endpoint. Rank 0 is the stage process: it owns the engine, the scheduler,
every request's state and the server. Ranks 1.. are worker processes it starts
(`services/dit/parallel_worker.py`, one device and their share of the cores each; forked from a
stage launcher where it can, see `Workers`); they hold
the same transformer and, of a request, at most their shards of its step-cache residuals
(services/dit/parallel_cache.py). Each transformer forward of rank 0 is broadcast to every rank
(rows, timesteps, text, mask, image shapes, each row's CFG branch and step-cache plan, the
requests whose shards to free), every rank runs its share, and rank 0 collects the prediction:

- `parallel_cfg: 2` splits the forward's rows by branch: the conditional rows run on the ranks
  of CFG index 0, the unconditional ones on those of index 1. A lone or unguided row leaves the
  second half empty: its ranks then run no block, and no collective depends on a half having
  rows (every rank derives the same plan from the same broadcast, so the one-branch deadlock
  cannot happen by construction).
- `parallel_ulysses: N` shards each half's tokens over N ranks and exchanges attention heads
  all-to-all: diffusers' own context parallelism (the transformer's `_cp_plan`, its Ulysses
  attention), set up on a CPU device mesh here because `enable_parallelism` needs an
  accelerator. The text is padded (and masked) to a multiple of N; the image tokens must divide.

Block-level interrupt is a collective: before every block every rank (those of an empty half
too, block by block) takes part in one all-reduce of rank 0's interrupt flag, so all ranks stop
at the same block. A rank that raises anything else, or dies, is a group fault (see
`Workers`).

Where the ranks compute is chosen in one place, `GroupDevices`, from where rank 0's transformer
lies: on the CPU every rank is a CPU process and gloo carries everything; on CUDA rank r
computes on `cuda:<base + r>` (base: rank 0's index), the forward's tensors and collectives are
on the device (NCCL, a CUDA device mesh), and the interrupt vote stays a host flag on a gloo
group of its own (no device sync per block). Both paths run the same code; only the CPU one
has run (tests/model/test_dit_parallel.py and friends), the CUDA one awaits a multi-GPU machine.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Protocol, TypedDict, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.hooks.context_parallel import apply_context_parallel
from diffusers.models._modeling_parallel import (
    ContextParallelConfig,
    ContextParallelModelPlan,
    ParallelConfig,
)
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

# torch.distributed re-exports it without saying so to type checkers
from torch._C._distributed_c10d import TCPStore
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from stagemesh.commands.stage import GROUP_WORKER_COMMAND
from stagemesh.launcher import ChildProcess, Launcher, StartMode, start_mode, start_stagemesh
from stagemesh.services.dit.forward import (
    Branch,
    RowAdapters,
    RowHooks,
    RowMeta,
    SlotUse,
    qwen_image_forward,
    wan_forward,
)
from stagemesh.services.dit.lora_slots import SlotStacks
from stagemesh.services.dit.parallel_cache import (
    ShardedFirstBlock,
    ShardStore,
    plans_from_tensors,
    plans_to_tensors,
)
from stagemesh.services.dit.step_cache import FirstBlockHooks, RowPlan
from stagemesh.shared.engine.adapter import InvalidInputError
from stagemesh.shared.engine.interrupt import StepInterrupt, StepInterrupted
from stagemesh.shared.ports import free_port
from stagemesh.shared.process import PARENT_PID_ENV, THREADS_ENV

log = logging.getLogger(__name__)

#: The mesh's dimensions, outermost first (diffusers' context parallelism needs "ring" and
#: "ulysses"; ring attention is not offered: its CPU backend mishandles padded text masks).
MESH_DIMS = ("cfg", "ring", "ulysses")
#: A collective that waits this long is a fault (rank 0 watches pids well before that).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
#: How long rank 0 waits for its workers to load their models and join the group.
START_TIMEOUT_S = 300.0
#: Where a group's ranks meet (one machine), and the store key a loaded worker sets.
LOOPBACK, READY_KEY = "127.0.0.1", "stagemesh/ready/"
#: How often rank 0 looks at its workers' pids.
WATCH_S = 0.2
#: How long a group fault's handler (stopping the engine and the workers) may take.
FAULT_HANDLING_S = 30.0
#: The broadcast header of a forward: [op, ndim, MAX_DIMS sizes of the hidden states, text
#: tokens, text dim, has mask, transformer, dtypes of hidden, text and timesteps (DTYPES
#: indices), has step-cache plans, freed cache keys, LoRA adapters per row (0: none), image
#: shapes, then up to MAX_SHAPES (frames, rows, columns)]. Of a LoRA slot sync: [op, new
#: stacks, bytes of their names, slots written, max_loras, max_lora_rank].
MAX_DIMS, MAX_SHAPES = 5, 8
HEADER_LEN = 2 + MAX_DIMS + 11 + 3 * MAX_SHAPES
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.int32)
OP_FORWARD, OP_STOP, OP_SLOTS = 1, 2, 3
#: The collectives' backend by device type; the interrupt vote always runs on VOTE_BACKEND.
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
VOTE_BACKEND = "gloo"
#: What a worker builds its transformers with (`Builder`, as `module:function`): a stage's
#: are the model folder's, built with the stage's options.
STAGE_BUILDER = "stagemesh.services.dit.servicer:group_family"
#: Environment of a worker: its rank, the group's size, where rank 0 listens.
RANK_ENV, WORLD_ENV, PORT_ENV = "STAGEMESH_DIT_RANK", "STAGEMESH_DIT_WORLD", "STAGEMESH_DIT_PORT"


class ParallelOptions(TypedDict, total=False):
    """The DiT's group options (flat, published in Describe); world size = their product."""

    parallel_cfg: int  # 1 | 2: conditional and unconditional rows on different ranks
    parallel_ulysses: int  # ranks that share each forward's tokens (divides the heads)


@dataclass(frozen=True)
class Degrees:
    """A group's shape: CFG-parallel degree x Ulysses degree ranks."""

    cfg: int = 1
    ulysses: int = 1

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses

    @classmethod
    def from_options(cls, options: ParallelOptions) -> Degrees:
        """The options, checked (the heads are checked by `check_heads`, once a model is read)."""
        cfg, ulysses = options.get("parallel_cfg", 1), options.get("parallel_ulysses", 1)
        if cfg not in (1, 2):
            raise ValueError(f"option parallel_cfg must be 1 or 2, got {cfg}")
        if not isinstance(ulysses, int) or ulysses < 1:
            raise ValueError(f"option parallel_ulysses must be a whole number >= 1, got {ulysses}")
        return cls(cfg, ulysses)

    def check_heads(self, heads: int) -> None:
        if heads % self.ulysses:
            raise ValueError(
                f"option parallel_ulysses={self.ulysses} must divide the model's {heads} heads")

    def place(self, rank: int) -> tuple[int, int]:
        """A rank's (CFG index, Ulysses index)."""
        return divmod(rank, self.ulysses)


@dataclass(frozen=True)
class GroupDevices:
    """Where each rank of a group computes: the one place a group's devices are chosen.
    `cpu`: every rank on the CPU (its share of the cores). `cuda`: rank r on
    `cuda:<base + r>`, base being rank 0's device index."""

    type: str = "cpu"
    base: int = 0

    @classmethod
    def named(cls, device: torch.device | str) -> GroupDevices:
        """The group whose rank 0 computes on `device`."""
        device = torch.device(device)
        if device.type not in BACKENDS:
            raise ValueError(f"a DiT group runs on {' or '.join(BACKENDS)} devices, not "
                             f"{device.type}")
        return cls(device.type, device.index or 0)

    @classmethod
    def of(cls, family: Family) -> GroupDevices:
        """The group whose rank 0 holds `family` (where its first transformer lies)."""
        return cls.named(next(family.transformers[0].parameters()).device)

    @property
    def backend(self) -> str:
        return BACKENDS[self.type]

    def rank(self, rank: int) -> torch.device:
        """The device of `rank`."""
        return torch.device("cpu") if self.type == "cpu" else torch.device(self.type,
                                                                           self.base + rank)

    def names(self, degrees: Degrees) -> list[str]:
        """Every rank's device, in rank order (Describe's group_devices)."""
        return [str(self.rank(rank)) for rank in range(degrees.world)]

    def check(self, degrees: Degrees) -> None:
        """The machine has a device for every rank (a ValueError naming the shortfall)."""
        if self.type == "cuda" and self.base + degrees.world > torch.cuda.device_count():
            raise ValueError(f"a DiT group of {degrees.world} ranks from cuda:{self.base} "
                             f"needs {self.base + degrees.world} CUDA devices, this machine has "
                             f"{torch.cuda.device_count()}")

    def enter(self, rank: int) -> None:
        """Make `rank`'s device the current one (before its process group starts)."""
        if self.type == "cuda":
            torch.cuda.set_device(self.rank(rank))


def worker_options(options: Mapping[str, object], rank: int) -> tuple[dict[str, object],
                                                                       GroupDevices]:
    """A worker's stage options (rank 0's, which name rank 0's device: `start_group`) with
    its own device, and the group's devices."""
    devices = GroupDevices.named(str(options.get("device", "cpu")))
    return {**options, "device": str(devices.rank(rank))}, devices


@dataclass(frozen=True)
class ForwardCall:
    """One transformer forward as every rank receives it."""

    hidden_states: torch.Tensor  # rows first: [rows, tokens, C] (Qwen), [rows, C, F, h, w] (Wan)
    encoder_hidden_states: torch.Tensor  # [rows, text, dim]
    encoder_hidden_states_mask: torch.Tensor | None  # [rows, text] bool (Qwen)
    timestep: torch.Tensor  # [rows]
    branches: tuple[Branch, ...]
    img_shapes: tuple[tuple[int, int, int], ...] = ()  # Qwen: the same for every row
    model: int = 0  # which of the family's transformers (Wan 2.2: 0 or 1)
    cache: tuple[RowPlan, ...] | None = None  # each row's first-block cache (None: no cache)
    freed: tuple[int, ...] = ()  # cache keys of the requests that left since the last forward
    #: each row's LoRA slots and scales (every rank holds the same slots: `GroupForward`)
    adapters: tuple[tuple[SlotUse, ...], ...] = ()

    @property
    def rows(self) -> list[RowMeta]:
        """What the forward knows of each row (no request ids: nothing on a rank needs them)."""
        adapters = self.adapters or ((),) * len(self.branches)
        return [RowMeta("", branch, uses)
                for branch, uses in zip(self.branches, adapters, strict=True)]

    def select(self, rows: Sequence[int]) -> ForwardCall:
        index = torch.tensor(rows, dtype=torch.long, device=self.hidden_states.device)
        mask = self.encoder_hidden_states_mask
        return replace(
            self, hidden_states=self.hidden_states[index],
            encoder_hidden_states=self.encoder_hidden_states[index],
            encoder_hidden_states_mask=None if mask is None else mask[index],
            timestep=self.timestep[index], branches=tuple(self.branches[i] for i in rows),
            cache=None if self.cache is None else tuple(self.cache[i] for i in rows),
            adapters=tuple(self.adapters[i] for i in rows) if self.adapters else ())


#: The transformers a group runs.
Transformer = QwenImageTransformer2DModel | WanTransformer3DModel


class Family(Protocol):
    """What a group runs of one model family: its transformers, the blocks of each (where the
    interrupt votes are taken), one forward over some rows, and a row's output shape."""

    @property
    def transformers(self) -> Sequence[Transformer]: ...

    def blocks(self, model: int) -> Sequence[torch.nn.Module]: ...

    def run(self, call: ForwardCall, ulysses: int, hooks: RowHooks | None,
            adapters: RowAdapters | None) -> torch.Tensor: ...

    def row_output(self, call: ForwardCall) -> tuple[int, ...]: ...


#: A worker's mirror of rank 0's LoRA slot stacks, given (max_loras, max_lora_rank).
StacksOf = Callable[[int, int], SlotStacks]
#: A worker's model: (source, its stage options) -> its family and the group's degrees.
Builder = Callable[[str, Mapping[str, object]], tuple["Family", Degrees]]


@dataclass(frozen=True)
class QwenImageFamily:
    transformer: QwenImageTransformer2DModel

    @property
    def transformers(self) -> Sequence[Transformer]:
        return [self.transformer]

    def blocks(self, model: int) -> Sequence[torch.nn.Module]:
        return list(self.transformer.transformer_blocks)

    def run(self, call: ForwardCall, ulysses: int, hooks: RowHooks | None,
            adapters: RowAdapters | None) -> torch.Tensor:
        embeds, mask = _padded_to(call.encoder_hidden_states, call.encoder_hidden_states_mask,
                                  ulysses)
        return qwen_image_forward(
            self.transformer, hidden_states=call.hidden_states, encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask, timestep=call.timestep,
            img_shapes=[list(call.img_shapes)] * len(call.branches), rows=call.rows,
            hooks=hooks, adapters=adapters)

    def row_output(self, call: ForwardCall) -> tuple[int, ...]:
        return (call.hidden_states.shape[1], self.transformer.proj_out.out_features)


@dataclass(frozen=True)
class WanFamily:
    models: Sequence[WanTransformer3DModel]

    @property
    def transformers(self) -> Sequence[Transformer]:
        return list(self.models)

    def blocks(self, model: int) -> Sequence[torch.nn.Module]:
        return list(self.models[model].blocks)

    def run(self, call: ForwardCall, ulysses: int, hooks: RowHooks | None,
            adapters: RowAdapters | None) -> torch.Tensor:
        return wan_forward(
            self.models[call.model], hidden_states=call.hidden_states, timestep=call.timestep,
            encoder_hidden_states=call.encoder_hidden_states, rows=call.rows, hooks=hooks,
            adapters=adapters)

    def row_output(self, call: ForwardCall) -> tuple[int, ...]:
        return (self.models[call.model].config["out_channels"], *call.hidden_states.shape[2:])


class Channel:
    """Rank 0's forwards, and what it writes into its LoRA slots, broadcast to every rank as
    tensors on the rank's device (nothing is pickled): a header of integers (the shapes,
    dtypes, image shapes and transformer), then the tensors."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def send(self, call: ForwardCall) -> None:
        hidden, encoder = call.hidden_states, call.encoder_hidden_states
        if hidden.ndim > MAX_DIMS or len(call.img_shapes) > MAX_SHAPES:
            raise ValueError(f"at most {MAX_DIMS} dimensions and {MAX_SHAPES} image shapes")
        dims = [*hidden.shape, *[0] * (MAX_DIMS - hidden.ndim)]
        header = [OP_FORWARD, hidden.ndim, *dims, *encoder.shape[1:],
                  int(call.encoder_hidden_states_mask is not None), call.model,
                  *(DTYPES.index(t.dtype) for t in (hidden, encoder, call.timestep)),
                  int(call.cache is not None), len(call.freed), _width(call.adapters),
                  len(call.img_shapes), *(n for shape in call.img_shapes for n in shape)]
        self._header(header)
        for tensor in self._tensors(call):
            dist.broadcast(tensor.contiguous(), src=0)

    def stop(self) -> None:
        self._header([OP_STOP])

    def send_slots(self, stacks: SlotStacks, new: Sequence[tuple[int, str]],
                   written: Sequence[int]) -> None:
        """The Linears that got stacks since the last sync (their transformer and name), then
        the slots written since: each one's rank, and its rows of every stack."""
        names = "\n".join(name for _, name in new).encode()
        self._header([OP_SLOTS, len(new), len(names), len(written), stacks.max_loras,
                      stacks.max_rank])
        if new:
            dist.broadcast(torch.tensor([model for model, _ in new], dtype=torch.int64,
                                        device=self.device), src=0)
            dist.broadcast(torch.tensor(list(names), dtype=torch.uint8, device=self.device),
                           src=0)
        if written:
            dist.broadcast(torch.tensor([[slot, stacks.slot_rank(slot)] for slot in written],
                                        dtype=torch.int64, device=self.device), src=0)
            index = torch.tensor(written, dtype=torch.long, device=stacks.device)
            for _, _, stack in stacks.stacks:
                for matrices in (stack.down, stack.up):
                    dist.broadcast(matrices[index].to(self.device).contiguous(), src=0)

    def _receive_slots(self, values: list[int], stacks_of: StacksOf) -> None:
        """A worker's side of `send_slots`: the same stacks, the same slots written."""
        new, name_bytes, count, max_loras, max_rank = values[1:6]
        stacks = stacks_of(max_loras, max_rank)
        if new:
            models = self._next((new,), torch.int64).tolist()
            names = bytes(self._next((name_bytes,), torch.uint8).tolist()).decode().split("\n")
            stacks.add_stacks(list(zip(models, names, strict=True)))
        if not count:
            return
        slots = self._next((count, 2), torch.int64).tolist()
        received = [[self._next((count, *matrices.shape[1:]), stacks.dtype)
                     for matrices in (stack.down, stack.up)] for _, _, stack in stacks.stacks]
        for i, (slot, rank) in enumerate(slots):
            stacks.write_slot(slot, rank, [(down[i], up[i].T) for down, up in received])

    def _header(self, values: list[int]) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)

    def _tensors(self, call: ForwardCall) -> list[torch.Tensor]:
        branches = torch.tensor([b is Branch.UNCOND for b in call.branches], dtype=torch.uint8,
                                device=self.device)
        # timesteps travel as float64: exact for every dtype a scheduler hands out
        tensors = [call.hidden_states, call.encoder_hidden_states,
                   call.timestep.to(torch.float64), branches]
        if call.encoder_hidden_states_mask is not None:
            tensors.append(call.encoder_hidden_states_mask.to(torch.uint8))
        if call.cache is not None:
            tensors.extend(plans_to_tensors(call.cache, self.device))
        if call.freed:
            tensors.append(torch.tensor(call.freed, dtype=torch.int64, device=self.device))
        if width := _width(call.adapters):
            # [rows, width] slots (-1: none) and scales
            slots = torch.full((len(call.branches), width), -1, dtype=torch.int64)
            scales = torch.zeros(len(call.branches), width, dtype=torch.float64)
            for row, uses in enumerate(call.adapters):
                for k, use in enumerate(uses):
                    slots[row, k], scales[row, k] = use.slot, use.scale
            tensors.extend((slots.to(self.device), scales.to(self.device)))
        return tensors

    def receive(self, stacks_of: StacksOf) -> ForwardCall | None:
        """The next forward (a worker's side); None when rank 0 stops the group. LoRA slot
        syncs before it are applied to the stacks `stacks_of` gives."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        values = header.tolist()
        while values[0] == OP_SLOTS:
            self._receive_slots(values, stacks_of)
            dist.broadcast(header, src=0)
            values = header.tolist()
        if values[0] == OP_STOP:
            return None
        ndim, dims = values[1], values[2: 2 + MAX_DIMS]
        (text, dim, has_mask, model, hidden_t, encoder_t, timestep_t, has_cache, freed, width,
         count, *rest) = values[2 + MAX_DIMS:]
        rows, device = dims[0], self.device
        hidden = torch.empty(dims[:ndim], dtype=DTYPES[hidden_t], device=device)
        encoder = torch.empty(rows, text, dim, dtype=DTYPES[encoder_t], device=device)
        timestep = torch.empty(rows, dtype=torch.float64, device=device)
        branches = torch.empty(rows, dtype=torch.uint8, device=device)
        for tensor in (hidden, encoder, timestep, branches):
            dist.broadcast(tensor, src=0)
        mask = self._next((rows, text), torch.uint8) if has_mask else None
        plans = (plans_from_tensors(self._next((rows, 4), torch.int64),
                                    self._next((rows,), torch.float64)) if has_cache else None)
        keys = tuple(self._next((freed,), torch.int64).tolist()) if freed else ()
        adapters: tuple[tuple[SlotUse, ...], ...] = ()
        if width:
            slots = self._next((rows, width), torch.int64).tolist()
            scales = self._next((rows, width), torch.float64).tolist()
            adapters = tuple(
                tuple(SlotUse(slot, scale) for slot, scale in zip(row, weights, strict=True)
                      if slot >= 0) for row, weights in zip(slots, scales, strict=True))
        return ForwardCall(
            hidden, encoder, None if mask is None else mask.to(torch.bool),
            timestep.to(DTYPES[timestep_t]),
            tuple(Branch.UNCOND if b else Branch.COND for b in branches.tolist()),
            tuple((rest[3 * i], rest[3 * i + 1], rest[3 * i + 2]) for i in range(count)), model,
            plans, keys, adapters)

    def _next(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor rank 0 broadcasts."""
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(tensor, src=0)
        return tensor


class GroupForward:
    """The group's share of one rank in every forward: `qwen_image` and `wan` on rank 0 (the
    adapters' transformer forwards: broadcast, compute this rank's share, collect), `serve` on
    workers. Every rank keeps the step-cache shards of the rows it runs (`store`)."""

    def __init__(self, family: Family, degrees: Degrees, rank: int, devices: GroupDevices,
                 votes: dist.ProcessGroup | None = None, tokens: DeviceMesh | None = None,
                 ) -> None:
        """votes: the (gloo) group the interrupt votes run on; None: the default group.
        tokens: the mesh of the ranks that share a forward's tokens (None: no Ulysses)."""
        self.family = family
        self.degrees = degrees
        self.rank = rank
        self.devices = devices
        self.device = devices.rank(rank)
        self._channel = Channel(self.device)
        self._votes = votes
        self._tokens = tokens
        self._interrupt: StepInterrupt | None = None
        #: Rank 0's workers: a forward that fails on rank 0 fails the group (`Workers.fail`).
        self.workers: Workers | None = None
        #: This rank's shards of the rows' step-cache residuals (services/dit/parallel_cache.py).
        self.store = ShardStore()
        self._freed: list[int] = []  # rank 0: cache keys to free with the next forward
        #: The LoRA slot stacks this rank's forwards apply: rank 0's are its adapter's bank,
        #: a worker's mirror them (made at the first sync, `Channel.send_slots`).
        self.slots: SlotStacks | None = None
        self._synced = 0  # rank 0: how many of its stacks the workers hold
        for model in range(len(family.transformers)):
            for block in family.blocks(model):
                block.register_forward_pre_hook(lambda module, args: self._vote())

    # -- rank 0 -------------------------------------------------------------------------------

    def bind_interrupt(self, interrupt: StepInterrupt) -> None:
        """Rank 0's interrupt: its flag is what every rank votes on before each block."""
        self._interrupt = interrupt

    # jscpd:ignore-start (the keyword signatures of forward.py's functions, which these replace)
    def qwen_image(
        self, transformer: QwenImageTransformer2DModel, *, hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor, img_shapes: list[list[tuple[int, int, int]]],
        rows: Sequence[RowMeta], hooks: RowHooks | None = None,
        adapters: RowAdapters | None = None,
    ) -> torch.Tensor:
        """`qwen_image_forward` over the group (rank 0)."""
        mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.bool()
        return self._lead(ForwardCall(
            hidden_states, encoder_hidden_states, mask, timestep,
            tuple(row.branch for row in rows), tuple(img_shapes[0]),
            adapters=_adapters(rows, adapters)), hooks, adapters)

    def wan(
        self, transformer: WanTransformer3DModel, *, hidden_states: torch.Tensor,
        timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, rows: Sequence[RowMeta],
        hooks: RowHooks | None = None, adapters: RowAdapters | None = None,
    ) -> torch.Tensor:
        """`wan_forward` over the group (rank 0), on whichever transformer it names."""
        # jscpd:ignore-end
        model = list(self.family.transformers).index(transformer)
        return self._lead(ForwardCall(
            hidden_states, encoder_hidden_states, None, timestep,
            tuple(row.branch for row in rows), model=model,
            adapters=_adapters(rows, adapters)), hooks, adapters)

    def _lead(self, call: ForwardCall, hooks: RowHooks | None,
              adapters: RowAdapters | None) -> torch.Tensor:
        if hooks is not None and not isinstance(hooks, FirstBlockHooks):
            raise ValueError(f"a parallel group runs no {type(hooks).__name__}")
        if adapters is not None and not isinstance(adapters, SlotStacks):
            raise ValueError(f"a parallel group runs no {type(adapters).__name__}")
        call = replace(call, freed=tuple(self._freed),
                       cache=None if hooks is None else tuple(hooks.plans(self._freed.append)))
        self._freed.clear()
        try:
            if adapters is not None:
                self._sync(adapters)
            self._channel.send(call)
            output, reused = self._run(call)
        except StepInterrupted:
            raise
        except Exception as exc:
            if self.workers is None:
                raise
            # Its ranks may be anywhere in the forward's collectives: none can be trusted to
            # take the next one in step. The group fails as one (the engine is told to shut
            # down first), and the batch ends at this boundary, aborted, not row by row.
            self.workers.fail(f"a sharded forward failed on rank 0: {exc!r}")
            raise StepInterrupted from exc
        if hooks is not None:
            hooks.settle(reused)
        return output

    def _sync(self, slots: SlotStacks) -> None:
        """Before a forward, the workers' stacks are made rank 0's: the Linears that got
        stacks and the slots written since the last forward (slots change only between
        forwards, on rank 0's engine thread, which also sends the forwards)."""
        self.slots = slots
        new = [(model, name) for model, name, _ in slots.stacks[self._synced:]]
        written = slots.take_written()
        if new or written:
            self._channel.send_slots(slots, new, written)
            self._synced = len(slots.stacks)

    def stop(self) -> None:
        """Tell the workers to leave their loop (rank 0, at shutdown)."""
        self._channel.stop()

    # -- every rank ---------------------------------------------------------------------------

    def serve(self) -> None:
        """A worker's loop: run each forward rank 0 broadcasts, until it stops the group. An
        interrupt ends a forward on every rank alike; anything else propagates (a fault).
        Nothing is kept for a backward pass (rank 0's forwards run in inference mode too)."""
        with torch.inference_mode():
            while (call := self._channel.receive(self._stacks_of)) is not None:
                try:
                    self._run(call)
                except StepInterrupted:
                    continue

    def _stacks_of(self, max_loras: int, max_rank: int) -> SlotStacks:
        """A worker's mirror of rank 0's slot stacks (made at the first sync)."""
        if self.slots is None:
            self.slots = SlotStacks(self.family.transformers, max_loras, max_rank)
        return self.slots

    def _half(self, call: ForwardCall, cfg_index: int) -> list[int]:
        """The rows the ranks of CFG index `cfg_index` run."""
        if self.degrees.cfg == 1:
            return list(range(len(call.branches)))
        want = Branch.COND if cfg_index == 0 else Branch.UNCOND
        return [i for i, branch in enumerate(call.branches) if branch is want]

    def _run(self, call: ForwardCall) -> tuple[torch.Tensor, list[bool]]:
        """This rank's share of `call`; on rank 0 the whole prediction, in row order, and each
        row's step-cache decision (True: it reused)."""
        self.store.free(call.freed)
        cfg_index, _ = self.degrees.place(self.rank)
        mine = self._half(call, cfg_index)
        hooks = self._hooks(call, mine)
        adapters = self.slots if call.adapters else None
        output = (self.family.run(call.select(mine), self.degrees.ulysses, hooks, adapters)
                  if mine else self._idle(call))
        reused = hooks.reused if hooks is not None else [False] * len(mine)
        if self.degrees.cfg == 1:
            return output, reused
        return self._collect(call, mine, output, reused)

    def _hooks(self, call: ForwardCall, mine: list[int]) -> ShardedFirstBlock | None:
        """This rank's step cache over its rows `mine` (None: no row caches)."""
        if call.cache is None or not mine:
            return None
        rest = self.family.blocks(call.model)[1:]
        return ShardedFirstBlock([call.cache[i] for i in mine], [call.branches[i] for i in mine],
                                 self.store, self._tokens, lambda: self._skip(rest))

    def _collect(self, call: ForwardCall, mine: list[int], output: torch.Tensor,
                 reused: list[bool]) -> tuple[torch.Tensor, list[bool]]:
        """CFG-parallel: the other half's leader sends its rows' output (and decisions) to
        rank 0, which puts every row in place."""
        theirs = self._half(call, 1)
        leader = self.degrees.ulysses  # rank of CFG index 1, Ulysses index 0
        cached = call.cache is not None
        if self.rank == leader and mine:
            dist.send(output.contiguous(), dst=0)
            if cached:
                dist.send(torch.tensor(reused, dtype=torch.uint8, device=self.device), dst=0)
        if self.rank != 0:
            return call.hidden_states[:0], []
        shape, dtype = self.family.row_output(call), call.hidden_states.dtype
        full = torch.empty(len(call.branches), *shape, dtype=dtype, device=self.device)
        flags = [False] * len(call.branches)
        if theirs:
            received = torch.empty(len(theirs), *shape, dtype=dtype, device=self.device)
            dist.recv(received, src=leader)
            full[theirs] = received
            if cached:
                decided = torch.empty(len(theirs), dtype=torch.uint8, device=self.device)
                dist.recv(decided, src=leader)
                for i, flag in zip(theirs, decided.tolist(), strict=True):
                    flags[i] = bool(flag)
        if mine:  # always: every state has a conditional row
            full[mine] = output
            for i, flag in zip(mine, reused, strict=True):
                flags[i] = flag
        return full, flags

    def _idle(self, call: ForwardCall) -> torch.Tensor:
        """An empty half: no block runs, but every block's interrupt vote is taken."""
        self._skip(self.family.blocks(call.model))
        return call.hidden_states[:0]

    def _skip(self, blocks: Sequence[torch.nn.Module]) -> None:
        """The interrupt votes of `blocks`, which this rank does not run."""
        for _ in blocks:
            self._vote()

    def _vote(self) -> None:
        """One all-reduce of rank 0's interrupt flag (a host tensor on the vote group); every
        rank raises alike."""
        flag = torch.zeros(1, dtype=torch.int32)
        if self._interrupt is not None and self._interrupt.requested():
            flag[0] = 1
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._votes)
        if flag.item():
            raise StepInterrupted


def _adapters(rows: Sequence[RowMeta],
              adapters: RowAdapters | None) -> tuple[tuple[SlotUse, ...], ...]:
    """Each row's LoRA slots for the broadcast; () when the forward applies none."""
    if adapters is None or not any(row.adapters for row in rows):
        return ()
    return tuple(row.adapters for row in rows)


def _width(adapters: Sequence[tuple[SlotUse, ...]]) -> int:
    """The most adapters a row of a forward runs (0: none)."""
    return max((len(uses) for uses in adapters), default=0)


def _padded_to(embeds: torch.Tensor, mask: torch.Tensor | None,
               multiple: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The text right-padded to a multiple of `multiple` tokens, the padding masked (the rotary
    positions of the real tokens do not move: Qwen's text positions start at 0)."""
    extra = -embeds.shape[1] % multiple
    if not extra:
        return embeds, mask
    rows, length = embeds.shape[:2]
    if mask is None:
        mask = torch.ones(rows, length, dtype=torch.bool, device=embeds.device)
    return F.pad(embeds, (0, 0, 0, extra)), F.pad(mask, (0, extra), value=False)


def check_tokens(degrees: Degrees, tokens: int) -> None:
    """A forward's image or video tokens (output and condition images) must divide among the
    Ulysses ranks; INVALID_ARGUMENT otherwise."""
    if tokens % degrees.ulysses:
        raise InvalidInputError(
            "height", f"this stage shares {tokens} image tokens among {degrees.ulysses} ranks: "
                      "the token count must be a multiple of parallel_ulysses")


# -- the group's processes ------------------------------------------------------------------


def join_group(rank: int, world: int, port: int, devices: GroupDevices) -> None:
    """A worker joins the group's process group once its model is loaded: it says so in
    rank 0's store (`lead_group` waits for that), then joins."""
    store = TCPStore(LOOPBACK, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(f"{READY_KEY}{rank}", "1")
    _init(store, rank, world, devices)


def _init(store: TCPStore, rank: int, world: int, devices: GroupDevices) -> None:
    devices.enter(rank)
    device_id = devices.rank(rank) if devices.type != "cpu" else None
    dist.init_process_group(devices.backend, store=store, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT, device_id=device_id)


def lead_group(workers: Workers) -> None:
    """Rank 0 joins the group once every worker has loaded its model; a worker that ends
    before that fails the start at once (not after a collective's timeout)."""
    world = workers.degrees.world
    store = TCPStore(LOOPBACK, workers.port, world, is_master=True,
                          timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    keys = [f"{READY_KEY}{rank}" for rank in range(1, world)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if dead := workers.dead():
            raise RuntimeError(f"DiT group rank(s) {dead} ended before the group started")
        try:
            store.wait(keys, timedelta(seconds=WATCH_S))
            break
        except dist.DistStoreError:
            if time.monotonic() > deadline:
                raise
    _init(store, 0, world, workers.devices)


def shard_family(family: Family, degrees: Degrees, rank: int,
                 devices: GroupDevices) -> GroupForward:
    """Apply the group to the family's transformers on this rank: the device mesh (every rank
    builds every sub-group, in one order), diffusers' Ulysses attention and `_cp_plan` hooks
    when ulysses > 1, the interrupt votes' gloo group. What `enable_parallelism` does, minus
    the accelerator it insists on."""
    mesh = init_device_mesh(devices.type, (degrees.cfg, 1, degrees.ulysses),
                            mesh_dim_names=MESH_DIMS)
    votes = dist.new_group(backend=VOTE_BACKEND)
    tokens = None
    if degrees.ulysses > 1:
        context = ContextParallelConfig(ulysses_degree=degrees.ulysses)
        config = ParallelConfig(context_parallel_config=context)
        config.setup(rank, degrees.world, devices.rank(rank), mesh=mesh)
        tokens = context._flattened_mesh
        for transformer in family.transformers:
            for module in transformer.modules():
                processor = getattr(module, "processor", None)
                if processor is not None and hasattr(processor, "_parallel_config"):
                    processor._parallel_config = config
            plan = cast(dict[str, ContextParallelModelPlan], transformer._cp_plan)
            apply_context_parallel(transformer, context, plan)
    return GroupForward(family, degrees, rank, devices, votes, tokens)


class Workers:
    """Rank 0's worker processes: started together, watched by pid, stopped together.

    A worker is `stagemesh dit-group-worker ARGS`: forked from a stage launcher (a process that
    has imported torch, diffusers and the stage code once: `stagemesh.launcher`) when there is
    one, so that it only loads its model; spawned otherwise (each then imports them itself,
    ~6.5 s of CPU). A group of more than two ranks starts a launcher of its own (one import
    instead of one per worker; it dies with rank 0, its children with it); tests share one
    for all their groups (`start_group(launcher=...)`)."""

    def __init__(self, args: Sequence[str], degrees: Degrees, threads: int,
                 devices: GroupDevices, env: Mapping[str, str] | None = None,
                 launcher: Launcher | None = None) -> None:
        """args: the worker's BUILDER SOURCE OPTIONS; launcher: one to fork the workers from
        (its owner closes it); None: this group starts its own when it has more than one
        worker."""
        self.port = free_port(LOOPBACK)
        self.degrees = degrees
        self.devices = devices
        base = {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid()),
                THREADS_ENV: str(threads), PORT_ENV: str(self.port),
                WORLD_ENV: str(degrees.world)}
        #: The launcher this group started for itself (closed with the workers).
        # (forking needs Linux, and an operator may turn it off: STAGEMESH_STAGE_LAUNCHER)
        own = launcher is None and degrees.world > 2 and start_mode() is StartMode.FORK
        self._own_launcher = Launcher.start(base) if own else None
        launcher = launcher or self._own_launcher
        self.processes: list[ChildProcess] = [
            start_stagemesh([GROUP_WORKER_COMMAND, *args], {**base, RANK_ENV: str(rank)},
                            launcher)
            for rank in range(1, degrees.world)]
        #: Set once the group failed, after `watch`'s `on_fault` has run.
        self.fault = threading.Event()
        self._stopping = threading.Event()  # rank 0 ends them: no fault
        self._on_fault: Callable[[str], None] | None = None
        self._failing = threading.Lock()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def dead(self) -> list[int]:
        """The ranks whose process has ended."""
        return [rank for rank, process in enumerate(self.processes, start=1)
                if process.poll() is not None]

    def watch(self, on_fault: Callable[[str], None]) -> None:
        """`on_fault` is what a group fault does (`fail`); a watcher thread fails the group
        when a worker process ends on its own."""
        self._on_fault = on_fault

        def loop() -> None:
            while not self._stopping.wait(WATCH_S):
                if dead := self.dead():
                    self.fail(f"DiT group rank(s) {dead} ended")
                    return

        threading.Thread(target=loop, name="dit-group-watch", daemon=True).start()

    def fail(self, reason: str) -> None:
        """The group's fault, handled once: `on_fault` (or, unwatched, stopping every
        worker) runs on a thread of its own, since the engine's compute thread may be the
        caller and `on_fault` stops that engine; `fault` is set when it is done."""
        if not self._failing.acquire(blocking=False):
            self.fault.wait(FAULT_HANDLING_S)
            return
        log.error("DiT group fault: %s", reason)
        handler = self._on_fault or (lambda _: self.stop())
        thread = threading.Thread(target=handler, args=(reason,), name="dit-group-fault")
        thread.start()
        thread.join(FAULT_HANDLING_S)
        self.fault.set()

    def retire(self) -> None:
        """From now on a worker that ends is no fault (rank 0 is ending the group)."""
        self._stopping.set()

    def stop(self, timeout: float = 5.0) -> None:
        """End every worker still running (a fault's other ranks, or the group at its end),
        then the group's own launcher."""
        self.retire()
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._own_launcher is not None:
            self._own_launcher.close()



def start_group(family: Family, source: Path | str, options: Mapping[str, object],
                degrees: Degrees, builder: str = STAGE_BUILDER,
                launcher: Launcher | None = None) -> tuple[GroupForward, Workers]:
    """Rank 0's start: the workers (each builds `family`'s equal from `source` with `builder`
    and the stage's `options`, on its own device: `worker_options`; forked from `launcher` if
    given, see `Workers`) with this process's share of the cores each, then the group joined
    and sharded. The group starts as one: a failure stops every worker."""
    for transformer in family.transformers:
        degrees.check_heads(transformer.config["num_attention_heads"])
    devices = GroupDevices.of(family)
    devices.check(degrees)
    threads = max(1, torch.get_num_threads() // degrees.world)
    torch.set_num_threads(threads)
    options = {**options, "device": str(devices.rank(0))}
    workers = Workers([builder, str(source), json.dumps(options)], degrees, threads, devices,
                      launcher=launcher)
    try:
        lead_group(workers)
        group = shard_family(family, degrees, 0, devices)
        group.workers = workers
        return group, workers
    except BaseException:
        workers.stop()
        raise


@contextmanager
def running_group(family: Family, source: Path | str, degrees: Degrees,
                  builder: str = STAGE_BUILDER,
                  launcher: Launcher | None = None) -> Iterator[GroupForward]:
    """A group over `family` while the block runs, this process its rank 0 (benchmarks, tests:
    a stage's group lives as long as its process); its workers build from `source`."""
    options = {"parallel_cfg": degrees.cfg, "parallel_ulysses": degrees.ulysses}
    group, workers = start_group(family, source, options, degrees, builder, launcher)
    try:
        yield group
    finally:
        stop_group(group, workers)


def stop_group(group: GroupForward, workers: Workers) -> None:
    """Rank 0's end: the workers leave their loop, the process group is destroyed."""
    workers.retire()
    if not (workers.fault.is_set() or workers.dead()):
        group.stop()
    workers.stop()
    dist.destroy_process_group()
