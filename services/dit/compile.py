"""Regional compilation of the DiT: the stage option `compile` (`off` | `blocks`).

`blocks` compiles the forward of the transformer's repeated block class once (torch.compile,
dynamic shapes) and every block calls that one compiled function with itself as an argument,
so the blocks share their graphs (what diffusers' `compile_repeated_blocks` aims at). Only a
block's own computation is compiled (ARCHITECTURE §10): the block loop, the per-row subsets the
step cache selects after the first block and the interrupt pre-hooks stay in Python, because
the module's `__call__` (which runs the hooks) is left as it is and calls the compiled forward.

Image sizes, text lengths and the rows of a step batch are dynamic dimensions; torch still
specializes a dimension of size 1 (one row, one text token), so the warm-up at start runs the
sizes and batch shapes the stage serves (`warm_up`) and no request pays a compile. Every graph
compiled after the warm-up is counted in `stagemesh_dit_recompiles_total` and logged: a rising
count is a bug (a guard the warm-up did not cover).

Every DiT model compiles: Qwen-Image, Qwen-Image-Edit (its condition image's tokens only
lengthen the image sequence the blocks see; the warm-up's requests carry one) and Wan (both
transformers of a Wan 2.2 folder share the block class, so its warm-up runs every step, past
the boundary). Not with `lora_dir`: the slots' per-row product is a forward hook on the
Linears inside the blocks (services/dit/lora_slots.py), so it would be traced into the graphs,
and its bound/unbound state and adapter count per row are more specializations to warm up
(`refuse_with_loras`).
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypedDict, TypeVar

import torch
from prometheus_client import Counter

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.dit.limits import DitLimits
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.dit.wan_adapter import VideoDenoiseInput, WanDenoiseAdapter
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, StepBudget

logger = logging.getLogger(__name__)

#: The option's name.
OPTION = "compile"

RECOMPILES = Counter(
    "stagemesh_dit_recompiles_total",
    "Graphs the DiT's compiled blocks compiled after the stage's warm-up (0 when healthy)",
)


class CompileMode(enum.Enum):
    OFF = "off"
    BLOCKS = "blocks"


class CompileOptions(TypedDict, total=False):
    """The DiT's compile option (published in Describe)."""

    #: off | blocks; YAML 1.1 reads a bare `off` as false, which means off
    compile: str | bool


def from_options(options: CompileOptions) -> CompileMode:
    """The option, checked; ValueError naming it for an unknown value."""
    name = options.get(OPTION, CompileMode.OFF.value)
    if name is False:
        name = CompileMode.OFF.value
    modes = {mode.value: mode for mode in CompileMode}
    if name not in modes:
        raise ValueError(f"stage dit: option {OPTION} must be one of {sorted(modes)}, "
                         f"got {name!r}")
    return modes[name]


def refuse_with_loras(mode: CompileMode, lora_dir: bool) -> None:
    """`compile: blocks` with `lora_dir` stops the stage at start: the slots' per-row product
    is a forward hook on the Linears inside the blocks, so it would run inside the compiled
    graphs, and whether rows are bound and how many adapters a row runs are more
    specializations (a graph each, times every batch shape) than a warm-up should compile."""
    if mode is not CompileMode.OFF and lora_dir:
        raise ValueError(f"stage dit: option {OPTION}=blocks cannot be combined with lora_dir "
                         f"(LoRA's per-row product runs inside the blocks); set {OPTION}: off")


class BlockCompiler:
    """Compiles a transformer's repeated blocks; counts the graphs it compiles, and after
    `warmed()` every further one as a recompile."""

    def __init__(self) -> None:
        # No duck sizing: torch gives two input sizes that happen to be equal when a graph is
        # traced one symbol and guards that they stay equal. Qwen-Image's 16 image tokens at
        # 64x64 equal its rotary table's 16 columns, so every size after that recompiled, and
        # past dynamo's recompile_limit (8) the blocks ran eagerly without a word.
        torch.fx.experimental._config.use_duck_shape = False
        self.graphs = 0  # graphs compiled so far (warm-up included)
        self._warm = False
        #: one compiled forward per block class: every block (of every transformer compiled
        #: by this compiler) shares its graphs
        self._forwards: dict[type[torch.nn.Module], Callable[..., object]] = {}

    def compile(self, blocks: Iterable[torch.nn.Module]) -> None:
        """Make every block of `blocks` run its class's shared compiled forward."""
        for block in blocks:
            kind = type(block)
            if kind not in self._forwards:
                self._forwards[kind] = torch.compile(kind.forward, dynamic=True,
                                                     backend=self._backend)
            # an instance attribute: Module.__call__ still runs the (interrupt) hooks eagerly
            block.forward = functools.partial(self._forwards[kind], block)

    def warmed(self) -> None:
        """The warm-up is over: from now on a compiled graph is a recompile."""
        self._warm = True
        logger.info("compiled DiT blocks warmed up: %d graphs", self.graphs)

    def _backend(self, graph: torch.fx.GraphModule,
                 inputs: list[torch.Tensor]) -> Callable[..., object]:
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        if self._warm:
            RECOMPILES.inc()
            logger.warning("DiT block recompiled after warm-up (graph %d): a shape or guard "
                           "the warm-up did not cover", self.graphs)
        compiled = compile_fx(graph, inputs)
        if not callable(compiled):  # compile_fx's other return types are for export
            raise TypeError(f"inductor returned {type(compiled).__name__}, not a callable")
        return compiled


#: The batches the warm-up runs at each size: (text lengths of the requests' prompts, negative
#: prompt length or 0 for none, whether the prompt carries a mask). Together they reach every
#: specialization a request can: one row and several, text padded (a mask) or not, a text of
#: one token, one row that keeps its mask (a step-cache subset of a padded batch).
WARMUP_BATCHES: tuple[tuple[tuple[int, ...], int, bool], ...] = (
    ((7,), 0, False),  # one row, no mask
    ((1,), 0, False),  # one row, one text token
    ((6,), 0, True),  # one row with a mask
    ((5,), 3, False),  # one guided request: two rows, padded
    ((4, 4, 4), 0, False),  # three rows, no mask
)
#: A Wan model's batches: it takes no mask, and runs rows of one text length in one forward,
#: so a guided request whose prompts are equally long is its two-row batch.
VIDEO_WARMUP_BATCHES: tuple[tuple[tuple[int, ...], int, bool], ...] = (
    ((7,), 0, False),  # one row
    ((1,), 0, False),  # one row, one text token
    ((5,), 5, False),  # one guided request: two rows
    ((4, 4, 4), 0, False),  # three rows
)
#: The image sides (height, width) the warm-up runs, each kept only where the stage serves it;
#: every side is a dynamic dimension, so they cover the others.
WARMUP_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (128, 96))
#: Guidance of a warm-up request with a negative prompt (any scale above 1 guides).
WARMUP_GUIDANCE = 4.0

PayloadT = TypeVar("PayloadT")
PayloadT_contra = TypeVar("PayloadT_contra", contravariant=True)
StateT = TypeVar("StateT")


class _Stepped(Protocol[PayloadT_contra, StateT]):
    """What the warm-up drives of a DiT adapter."""

    limits: DitLimits

    def check_inputs(self, payload: PayloadT_contra) -> None: ...

    def prepare(self, request: EngineRequest[PayloadT_contra]) -> StateT: ...

    def step(self, states: Sequence[StateT]) -> object: ...

    def release(self, state: StateT) -> None: ...


#: One warm-up request's payload, from (height, width, index, text length, negative length,
#: masked, steps).
MakePayload = Callable[[int, int, int, int, int, bool, int], PayloadT]


def warm_up(adapter: DenoiseAdapter | WanDenoiseAdapter, compiler: BlockCompiler) -> None:
    """Every warm-up batch at every `WARMUP_SIZES` the stage serves, through the adapter's own
    steps (so the blocks see exactly the inputs a request gives them), then `warmed()`."""
    if isinstance(adapter, WanDenoiseAdapter):
        _warm_up(adapter, VIDEO_WARMUP_BATCHES, functools.partial(_video_payload, adapter))
    else:
        _warm_up(adapter, WARMUP_BATCHES, functools.partial(_image_payload, adapter))
    compiler.warmed()


def _warm_up(adapter: _Stepped[PayloadT, StateT],
             batches: tuple[tuple[tuple[int, ...], int, bool], ...],
             payload: MakePayload[PayloadT]) -> None:
    """Each batch runs all its steps, so (Wan 2.2) the second transformer's blocks run too; a
    size any request of the batches would be refused at is skipped."""
    steps = max(adapter.limits.min_steps, 2)
    for height, width in WARMUP_SIZES:
        payloads = [[payload(height, width, index, length, negative, masked, steps)
                     for index, length in enumerate(lengths)]
                    for lengths, negative, masked in batches]
        try:
            for batch in payloads:
                for one in batch:
                    adapter.check_inputs(one)
        except InvalidInputError as refused:
            logger.info("compile warm-up skips %dx%d: the stage does not serve it (%s)",
                        width, height, refused)
            continue
        for batch in payloads:
            states = [adapter.prepare(EngineRequest(
                request_id=f"warm-up-{index}", budget=StepBudget(total_steps=steps),
                payload=one)) for index, one in enumerate(batch)]
            try:
                for _ in range(steps):
                    adapter.step(states)
            finally:
                for state in states:
                    adapter.release(state)


def _image_payload(adapter: DenoiseAdapter, height: int, width: int, index: int, length: int,
                   negative: int, masked: bool, steps: int) -> DenoiseInput:
    """A Qwen-Image request; an edit model's carries a condition image of the output's size."""
    factor, channels = adapter.vae_scale_factor, adapter.transformer.config["in_channels"] // 4
    condition = torch.randn(1, channels, 1, height // factor, width // factor)
    return DenoiseInput(
        embeddings=_embeddings(length, negative, masked,
                               adapter.transformer.config["joint_attention_dim"]),
        height=height, width=width, num_inference_steps=steps,
        true_cfg_scale=WARMUP_GUIDANCE if negative else 1.0, seed=index,
        condition_latents=(condition,) * adapter.limits.max_condition_images)


def _video_payload(adapter: WanDenoiseAdapter, height: int, width: int, index: int,
                   length: int, negative: int, masked: bool, steps: int) -> VideoDenoiseInput:
    """A Wan request of the fewest frames past one (a frame axis longer than 1); an
    image-to-video model's carries its first-frame latents."""
    frames = adapter.limits.frame_multiple + 1
    shape = adapter.folder.latent_shape(frames, height, width)
    return VideoDenoiseInput(
        embeddings=_embeddings(length, negative, masked,
                               adapter.transformers[0].config["text_dim"]),
        height=height, width=width, num_frames=frames, num_inference_steps=steps,
        guidance_scale=WARMUP_GUIDANCE if negative else 1.0, seed=index,
        condition_latents=(torch.randn(shape),) * adapter.limits.max_condition_images)


def _embeddings(length: int, negative: int, masked: bool, dim: int) -> PromptEmbeddings:
    return PromptEmbeddings(
        prompt_embeds=torch.randn(1, length, dim),
        prompt_embeds_mask=torch.ones(1, length, dtype=torch.long) if masked else None,
        negative_prompt_embeds=torch.randn(1, negative, dim) if negative else None)
