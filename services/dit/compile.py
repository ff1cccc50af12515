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
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TypedDict

import torch
from prometheus_client import Counter

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.dit.checks import check_size
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
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


class BlockCompiler:
    """Compiles a transformer's repeated blocks; counts the graphs it compiles, and after
    `warmed()` every further one as a recompile."""

    def __init__(self) -> None:
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
#: The image sides (height, width) the warm-up runs, each kept only where the stage serves it;
#: every side is a dynamic dimension, so they cover the others.
WARMUP_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (128, 96))


def warm_up(adapter: DenoiseAdapter, compiler: BlockCompiler) -> None:
    """One step of every `WARMUP_BATCHES` at every `WARMUP_SIZES` the stage serves, through the
    adapter's own step (so the blocks see exactly the inputs a request gives them)."""
    text_dim = adapter.transformer.config["joint_attention_dim"]
    steps = adapter.limits.min_steps
    for height, width in WARMUP_SIZES:
        try:
            check_size(adapter.limits, height, width)
        except InvalidInputError:
            continue
        for lengths, negative, masked in WARMUP_BATCHES:
            requests = [EngineRequest(
                request_id=f"warm-up-{index}", budget=StepBudget(total_steps=steps),
                payload=DenoiseInput(
                    embeddings=_embeddings(length, negative, masked, text_dim),
                    height=height, width=width, num_inference_steps=steps,
                    true_cfg_scale=4.0 if negative else 1.0, seed=index))
                for index, length in enumerate(lengths)]
            states = [adapter.prepare(request) for request in requests]
            try:
                adapter.step(states)
            finally:
                for state in states:
                    adapter.release(state)
    compiler.warmed()


def _embeddings(length: int, negative: int, masked: bool, dim: int) -> PromptEmbeddings:
    return PromptEmbeddings(
        prompt_embeds=torch.randn(1, length, dim),
        prompt_embeds_mask=torch.ones(1, length, dtype=torch.long) if masked else None,
        negative_prompt_embeds=torch.randn(1, negative, dim) if negative else None)
