"""DiT stage servicer: Denoise over the DenoiseAdapter, one engine step per denoise step.

Continuous batching: up to `max_batch` requests of one image size advance together, one
transformer forward per tick; up to `max_running` hold state (the batch plus requests preempted
by more urgent ones, lower `priority` first).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TypeAlias, TypedDict

import grpc

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.options import capped_option
from stagemesh.services.dit.adapter import (
    CPU_DTYPE,
    DenoiseAdapter,
    DenoisedLatents,
    DenoiseInput,
    DenoiseState,
    DitLimits,
)
from stagemesh.shared.devices import DeviceOptions, Placement, resolve_placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    ExecutionMode,
    InvalidInputError,
    NoStream,
    StepBudget,
)
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.scheduler import (
    BURST_ADMISSION_WINDOW_SECONDS,
    resolve_total_steps,
)
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2_grpc
from stagemesh.shared.proto.v1 import dit_service_pb2 as pb
from stagemesh.shared.stage_runtime import StageBundle, stage_description
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.torch_tensors import from_proto, optional_from_proto, to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DitService"].full_name

MODES = {common_pb2.EXECUTION_MODE_STEP: ExecutionMode.STEP,
         common_pb2.EXECUTION_MODE_REQUEST: ExecutionMode.REQUEST}
MODE_TO_PROTO = {mode: value for value, mode in MODES.items()}

DitEngine: TypeAlias = StepEngine[
    DenoiseInput, NoStream, DenoiseState, NoStream, DenoisedLatents
]

#: Requests that run at once (the most one forward advances) unless the recipe sets `max_batch`.
DEFAULT_MAX_BATCH = 8
#: Requests holding state (running plus preempted) unless the recipe sets `max_running`.
DEFAULT_MAX_RUNNING = 16
#: How long an idle DiT waits for requests sent together to arrive, so that they start in one
#: forward instead of the first running ahead alone (`stagemesh.shared.engine.scheduler`,
#: "Batch forming"), unless the recipe sets `admission_window_ms`.
DEFAULT_ADMISSION_WINDOW_MS = BURST_ADMISSION_WINDOW_SECONDS * 1000
#: The longest window an operator may set: beyond it a lone request pays too much to wait.
MAX_ADMISSION_WINDOW_MS = 1000.0


class DitModeOptions(TypedDict, total=False):
    """How the stage runs a request by default (step execution unless set false)."""

    step_execution: bool  # false = REQUEST mode is the default: a running request ignores aborts
    #: true = clients may ask for REQUEST mode (the non-abortable comparison: a request that
    #: ignores cancels and deadlines blocks the stage); off unless the recipe allows it.
    request_mode: bool


class DitEngineOptions(EngineOptions, total=False):
    """The engine's options, plus `max_batch`: requests that run at once, and so the most one
    transformer forward advances (those of one image size share it)."""

    max_batch: int
    admission_window_ms: float  # 0 = admit each request as it comes



class DitLimitOptions(TypedDict, total=False):
    """The stage's limits: DenoiseAdapter's keyword arguments (each capped by the model)."""

    max_steps: int
    max_pixels: int
    max_side: int
    max_true_cfg_scale: float
    max_images_per_request: int


def _request(message: pb.DenoiseRequest, deadline: float | None) -> EngineRequest[DenoiseInput]:
    start = message.start
    if start.execution_mode not in (common_pb2.EXECUTION_MODE_UNSPECIFIED, *MODES):
        raise InvalidInputError("execution_mode",
                                f"unknown execution_mode {start.execution_mode}")
    sigmas = list(start.sigmas) or None
    embeddings = PromptEmbeddings(
        prompt_embeds=from_proto(start.prompt_embeds),
        prompt_embeds_mask=optional_from_proto(start.prompt_embeds_mask),
        negative_prompt_embeds=optional_from_proto(start.negative_prompt_embeds),
        negative_prompt_embeds_mask=optional_from_proto(start.negative_prompt_embeds_mask))
    total = resolve_total_steps(None, sigmas, start.num_inference_steps)
    return EngineRequest(
        request_id=start.request_id, deadline=deadline, mode=MODES.get(start.execution_mode),
        budget=StepBudget(total_steps=total if total is not None else 0), priority=start.priority,
        payload=DenoiseInput(embeddings=embeddings, height=start.height, width=start.width,
                             num_inference_steps=start.num_inference_steps,
                             true_cfg_scale=start.true_cfg_scale, seed=start.seed,
                             sigmas=sigmas))


def _result(latents: DenoisedLatents) -> pb.DenoiseResult:
    return pb.DenoiseResult(latents=to_proto(latents.latents), height=latents.height,
                            width=latents.width)


WIRE: StageWire[pb.DenoiseRequest, pb.DenoiseResponse, DenoiseInput, NoStream, NoStream,
                DenoisedLatents] = StageWire(
    response_cls=pb.DenoiseResponse, make_request=_request, encode_result=_result)


class DitServicer(dit_service_pb2_grpc.DitServiceServicer):
    def __init__(self, engine: DitEngine, description: pb.DescribeDitResponse) -> None:
        self.engine = engine
        self.description = description

    async def Denoise(
        self,
        request_iterator: AsyncIterator[pb.DenoiseRequest],
        context: grpc.aio.ServicerContext[pb.DenoiseRequest, pb.DenoiseResponse],
    ) -> AsyncIterator[pb.DenoiseResponse]:
        async for response in serve_stage_stream(self.engine, WIRE, request_iterator, context):
            yield response

    async def DescribeDit(
        self,
        request: pb.DescribeDitRequest,
        context: grpc.aio.ServicerContext[pb.DescribeDitRequest, pb.DescribeDitResponse],
    ) -> pb.DescribeDitResponse:
        return self.description


def _describe(
    model_dir: Path, engine: DitEngine, limits: DitLimits, mode: ExecutionMode,
    placement: Placement, request_mode: bool = False,
) -> pb.DescribeDitResponse:
    """The stage's facts; execution_modes lists the default mode first, and REQUEST only
    when it is the default or the `request_mode` option allows it."""
    modes = [mode, *(other for other in ExecutionMode
                     if other is not mode and (other is not ExecutionMode.REQUEST
                                               or request_mode))]
    return pb.DescribeDitResponse(
        stage=stage_description("dit", model_dir, engine, placement),
        size_multiple=limits.size_multiple, max_side=limits.max_side,
        max_pixels=limits.max_pixels, max_steps=limits.max_steps, min_steps=limits.min_steps,
        max_true_cfg_scale=limits.max_true_cfg_scale,
        max_images_per_request=limits.max_images_per_request,
        execution_modes=[MODE_TO_PROTO[other] for other in modes])


def admission_window_seconds(options: DitEngineOptions) -> float:
    """The `admission_window_ms` option (default DEFAULT_ADMISSION_WINDOW_MS), in seconds."""
    window = options.get("admission_window_ms", DEFAULT_ADMISSION_WINDOW_MS)
    if not 0 <= window <= MAX_ADMISSION_WINDOW_MS:
        raise ValueError(f"option admission_window_ms must be in [0, {MAX_ADMISSION_WINDOW_MS}], "
                         f"got {window}")
    return window / 1000


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """options: DitModeOptions, DitEngineOptions (max_batch 8, max_running 16, admission window
    20 ms by default),
    DitLimitOptions and DeviceOptions."""
    mode_options, engine_options, limit_options, device_options = parse_options(
        "dit", options, DitModeOptions, DitEngineOptions, DitLimitOptions, DeviceOptions)
    placement = resolve_placement("dit", device_options, CPU_DTYPE)
    step_execution = mode_options.get("step_execution", True)
    mode = ExecutionMode.STEP if step_execution else ExecutionMode.REQUEST
    adapter = DenoiseAdapter(model_dir, **limit_options, placement=placement)
    engine = StepEngine(
        adapter, mode=mode,
        max_running=capped_option(
            "max_running", engine_options.get("max_running", DEFAULT_MAX_RUNNING)),
        max_batch=capped_option("max_batch", engine_options.get("max_batch", DEFAULT_MAX_BATCH)),
        admission_window=admission_window_seconds(engine_options))
    servicer = DitServicer(engine, _describe(model_dir, engine, adapter.limits, mode,
                                             placement, mode_options.get("request_mode", False)))
    return StageBundle(
        name="dit", engines=[engine], service_names=[SERVICE_NAME],
        register=lambda server: dit_service_pb2_grpc.add_DitServiceServicer_to_server(
            servicer, server),
        info={"model": str(model_dir), **placement.facts(), "mode": mode.value,
              "max_running": str(engine.max_running), "max_batch": str(engine.max_batch)})
