"""One DiT over several ranks: CFG-parallel and Ulysses sequence-parallel stage groups.

A group is one gRPC endpoint. Rank 0 is the stage process: it owns the engine, the scheduler,
every request's state and the server. Ranks 1.. are worker processes it starts
(`services/dit/parallel_worker.py`, one device and their share of the cores each); they hold
the same transformer and nothing of any request. Each transformer forward of rank 0 is
broadcast to every rank (rows, timesteps, text, mask, image shapes, each row's CFG branch),
every rank runs its share, and rank 0 collects the prediction:

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
`GroupWatch`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypedDict, cast

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
from torch.distributed.device_mesh import init_device_mesh

from stagemesh.services.dit.forward import Branch, RowAdapters, RowHooks, RowMeta
from stagemesh.services.dit.forward import qwen_image_forward as one_device_forward
from stagemesh.shared.engine.adapter import InvalidInputError
from stagemesh.shared.engine.interrupt import StepInterrupt, StepInterrupted

log = logging.getLogger(__name__)

#: The mesh's dimensions, outermost first (diffusers' context parallelism needs "ring" and
#: "ulysses"; ring attention is not offered: its CPU backend mishandles padded text masks).
MESH_DIMS = ("cfg", "ring", "ulysses")
#: A collective that waits this long is a fault (rank 0 watches pids well before that).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
#: How long rank 0 waits for its workers to join the group.
START_TIMEOUT_S = 300.0
#: How often rank 0 looks at its workers' pids.
WATCH_S = 0.2
#: The broadcast header: [op, rows, tokens, channels, text tokens, text dim, has mask,
#: image shapes, then up to MAX_SHAPES (frames, rows, columns)].
MAX_SHAPES = 8
HEADER_LEN = 8 + 3 * MAX_SHAPES
OP_FORWARD, OP_STOP = 1, 2
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
class ForwardCall:
    """One transformer forward as every rank receives it."""

    hidden_states: torch.Tensor  # [rows, tokens, channels]
    encoder_hidden_states: torch.Tensor  # [rows, text, dim]
    encoder_hidden_states_mask: torch.Tensor | None  # [rows, text] bool
    timestep: torch.Tensor  # [rows]
    img_shapes: tuple[tuple[int, int, int], ...]  # the same for every row
    branches: tuple[Branch, ...]

    def select(self, rows: Sequence[int]) -> ForwardCall:
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.encoder_hidden_states_mask
        return ForwardCall(
            self.hidden_states[index], self.encoder_hidden_states[index],
            None if mask is None else mask[index], self.timestep[index], self.img_shapes,
            tuple(self.branches[i] for i in rows))


class Channel:
    """Rank 0's forwards, broadcast to every rank as tensors (nothing is pickled)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype

    def send(self, call: ForwardCall) -> None:
        rows, tokens, channels = call.hidden_states.shape
        _, text, dim = call.encoder_hidden_states.shape
        if len(call.img_shapes) > MAX_SHAPES:
            raise ValueError(f"at most {MAX_SHAPES} image shapes per forward")
        shapes = [n for shape in call.img_shapes for n in shape]
        header = [OP_FORWARD, rows, tokens, channels, text, dim,
                  int(call.encoder_hidden_states_mask is not None), len(call.img_shapes), *shapes]
        self._header(header)
        for tensor in self._tensors(call):
            dist.broadcast(tensor.contiguous(), src=0)

    def stop(self) -> None:
        self._header([OP_STOP])

    @staticmethod
    def _header(values: list[int]) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(header, src=0)

    def _tensors(self, call: ForwardCall) -> list[torch.Tensor]:
        branches = torch.tensor([b is Branch.UNCOND for b in call.branches], dtype=torch.uint8)
        tensors = [call.hidden_states, call.encoder_hidden_states, call.timestep, branches]
        if call.encoder_hidden_states_mask is not None:
            tensors.append(call.encoder_hidden_states_mask.to(torch.uint8))
        return tensors

    def receive(self) -> ForwardCall | None:
        """The next forward (a worker's side); None when rank 0 stops the group."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0)
        op, rows, tokens, channels, text, dim, has_mask, count, *rest = header.tolist()
        if op == OP_STOP:
            return None
        hidden = torch.empty(rows, tokens, channels, dtype=self._dtype)
        encoder = torch.empty(rows, text, dim, dtype=self._dtype)
        timestep = torch.empty(rows, dtype=self._dtype)
        branches = torch.empty(rows, dtype=torch.uint8)
        for tensor in (hidden, encoder, timestep, branches):
            dist.broadcast(tensor, src=0)
        mask = None
        if has_mask:
            mask = torch.empty(rows, text, dtype=torch.uint8)
            dist.broadcast(mask, src=0)
        shapes = tuple((rest[3 * i], rest[3 * i + 1], rest[3 * i + 2]) for i in range(count))
        return ForwardCall(hidden, encoder, None if mask is None else mask.to(torch.bool),
                           timestep, shapes,
                           tuple(Branch.UNCOND if b else Branch.COND for b in branches.tolist()))


class GroupForward:
    """The group's share of one rank in every forward: `forward` on rank 0 (the adapter's
    transformer forward: it broadcasts, computes its share and collects), `serve` on workers."""

    def __init__(self, transformer: QwenImageTransformer2DModel, degrees: Degrees,
                 rank: int) -> None:
        self.transformer = transformer
        self.degrees = degrees
        self.rank = rank
        self._channel = Channel(transformer.dtype)
        self._interrupt: StepInterrupt | None = None
        self._blocks = len(transformer.transformer_blocks)
        for block in transformer.transformer_blocks:
            block.register_forward_pre_hook(lambda module, args: self._vote())

    # -- rank 0 -------------------------------------------------------------------------------

    def bind_interrupt(self, interrupt: StepInterrupt) -> None:
        """Rank 0's interrupt: its flag is what every rank votes on before each block."""
        self._interrupt = interrupt

    def forward(
        self, transformer: QwenImageTransformer2DModel, *, hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor, img_shapes: list[list[tuple[int, int, int]]],
        rows: Sequence[RowMeta], hooks: RowHooks | None = None,
        adapters: RowAdapters | None = None,
    ) -> torch.Tensor:
        """`qwen_image_forward` over the group (rank 0); hooks and adapters are not offered."""
        if hooks is not None or adapters is not None:
            raise ValueError("a parallel group runs no step cache and no LoRA adapters yet")
        mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.bool()
        call = ForwardCall(hidden_states, encoder_hidden_states, mask, timestep,
                           tuple(img_shapes[0]), tuple(row.branch for row in rows))
        self._channel.send(call)
        return self._run(call)

    def stop(self) -> None:
        """Tell the workers to leave their loop (rank 0, at shutdown)."""
        self._channel.stop()

    # -- every rank ---------------------------------------------------------------------------

    def serve(self) -> None:
        """A worker's loop: run each forward rank 0 broadcasts, until it stops the group. An
        interrupt ends a forward on every rank alike; anything else propagates (a fault)."""
        while (call := self._channel.receive()) is not None:
            try:
                self._run(call)
            except StepInterrupted:
                continue

    def _half(self, call: ForwardCall, cfg_index: int) -> list[int]:
        """The rows the ranks of CFG index `cfg_index` run."""
        if self.degrees.cfg == 1:
            return list(range(len(call.branches)))
        want = Branch.COND if cfg_index == 0 else Branch.UNCOND
        return [i for i, branch in enumerate(call.branches) if branch is want]

    def _run(self, call: ForwardCall) -> torch.Tensor:
        """This rank's share of `call`; on rank 0 the whole prediction, in row order."""
        cfg_index, _ = self.degrees.place(self.rank)
        mine = self._half(call, cfg_index)
        output = self._rows(call.select(mine)) if mine else self._idle()
        if self.degrees.cfg == 1:
            return output
        theirs = self._half(call, 1)
        leader = self.degrees.ulysses  # rank of CFG index 1, Ulysses index 0
        if self.rank == leader and mine:
            dist.send(output.contiguous(), dst=0)
        if self.rank != 0:
            return output
        full = torch.empty(len(call.branches), *output.shape[1:], dtype=output.dtype)
        if theirs:
            received = torch.empty(len(theirs), *output.shape[1:], dtype=output.dtype)
            dist.recv(received, src=leader)
            full[theirs] = received
        if mine:
            full[mine] = output
        return full

    def _rows(self, call: ForwardCall) -> torch.Tensor:
        embeds, mask = _padded_to(call.encoder_hidden_states, call.encoder_hidden_states_mask,
                                  self.degrees.ulysses)
        return one_device_forward(
            self.transformer, hidden_states=call.hidden_states, encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask, timestep=call.timestep,
            img_shapes=[list(call.img_shapes)] * len(call.branches),
            rows=[RowMeta("", branch) for branch in call.branches])

    def _idle(self) -> torch.Tensor:
        """An empty half: no block runs, but every block's interrupt vote is taken."""
        for _ in range(self._blocks):
            self._vote()
        return torch.empty(0, 1, self.transformer.proj_out.out_features,
                           dtype=self.transformer.dtype)

    def _vote(self) -> None:
        """One all-reduce of rank 0's interrupt flag; every rank raises alike."""
        flag = torch.zeros(1, dtype=torch.int32)
        if self._interrupt is not None and self._interrupt.requested():
            flag[0] = 1
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise StepInterrupted


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
    """A forward's image tokens (output and condition images) must divide among the Ulysses
    ranks; INVALID_ARGUMENT otherwise."""
    if tokens % degrees.ulysses:
        raise InvalidInputError(
            "height", f"this stage shares {tokens} image tokens among {degrees.ulysses} ranks: "
                      "the token count must be a multiple of parallel_ulysses")


# -- the group's processes ------------------------------------------------------------------


def join_group(rank: int, world: int, port: int) -> None:
    """This process joins the group's gloo process group (every rank calls it)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)


def shard_transformer(transformer: QwenImageTransformer2DModel, degrees: Degrees,
                      rank: int) -> GroupForward:
    """Apply the group to `transformer` on this rank: the device mesh (every rank builds every
    sub-group, in one order), diffusers' Ulysses attention and `_cp_plan` hooks when
    ulysses > 1, the interrupt votes. The reference for what `enable_parallelism` would do."""
    degrees.check_heads(transformer.config["num_attention_heads"])
    mesh = init_device_mesh("cpu", (degrees.cfg, 1, degrees.ulysses), mesh_dim_names=MESH_DIMS)
    if degrees.ulysses > 1:
        context = ContextParallelConfig(ulysses_degree=degrees.ulysses)
        config = ParallelConfig(context_parallel_config=context)
        config.setup(rank, degrees.world, torch.device("cpu"), mesh=mesh)
        for module in transformer.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = config
        plan = cast(dict[str, ContextParallelModelPlan], transformer._cp_plan)
        apply_context_parallel(transformer, context, plan)
    return GroupForward(transformer, degrees, rank)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Workers:
    """Rank 0's worker processes: started together, watched by pid, stopped together."""

    def __init__(self, args: Sequence[str], degrees: Degrees, threads: int,
                 env: Mapping[str, str] | None = None) -> None:
        """args: what a worker is started with after `python -m <worker module>`."""
        self.port = free_port()
        self.degrees = degrees
        base = {**os.environ, **(env or {}), "STAGEMESH_PARENT_PID": str(os.getpid()),
                "STAGEMESH_THREADS": str(threads), PORT_ENV: str(self.port),
                WORLD_ENV: str(degrees.world)}
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "stagemesh.services.dit.parallel_worker",
                              *args], env={**base, RANK_ENV: str(rank)})
            for rank in range(1, degrees.world)]
        self._watch: threading.Thread | None = None
        self.faulted = threading.Event()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def dead(self) -> list[int]:
        """The ranks whose process has ended."""
        return [rank for rank, process in enumerate(self.processes, start=1)
                if process.poll() is not None]

    def watch(self, on_fault: Callable[[str], None]) -> None:
        """Call `on_fault` once, from a watcher thread, when a worker process ends."""
        def loop() -> None:
            while not self.faulted.is_set():
                if dead := self.dead():
                    self.faulted.set()
                    on_fault(f"DiT group rank(s) {dead} ended")
                    return
                time.sleep(WATCH_S)

        self._watch = threading.Thread(target=loop, name="dit-group-watch", daemon=True)
        self._watch.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.faulted.set()  # an ending worker is no fault any more
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()



def start_group(transformer: QwenImageTransformer2DModel, args: Sequence[str],
                degrees: Degrees) -> tuple[GroupForward, Workers]:
    """Rank 0's start: the workers (`args` after the worker module: model folder and options),
    each with this process's share of the cores, then the group joined and sharded. The group
    starts as one: a failure stops every worker."""
    threads = max(1, torch.get_num_threads() // degrees.world)
    torch.set_num_threads(threads)
    workers = Workers(args, degrees, threads)
    try:
        join_group(0, degrees.world, workers.port)
        return shard_transformer(transformer, degrees, 0), workers
    except BaseException:
        workers.stop()
        raise


def stop_group(group: GroupForward, workers: Workers) -> None:
    """Rank 0's end: the workers leave their loop, the process group is destroyed."""
    workers.faulted.set()
    if not workers.dead():
        group.stop()
    workers.stop()
    dist.destroy_process_group()
