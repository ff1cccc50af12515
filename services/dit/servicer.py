"""DiT stage servicer: Denoise over the model's adapter, one engine step per denoise step.

The folder's model_index.json `_class_name` picks the adapter: QwenImage* pipelines run on
`DenoiseAdapter` (text-to-image, image edit), Wan* pipelines on `WanDenoiseAdapter`
(text-to-video, image-to-video). One engine either way; the wire differs only in which
DenoiseStart fields the model takes (a field it does not take is INVALID_ARGUMENT naming it).

Continuous batching: up to `max_batch` requests of one image size (video shape) advance
together, one transformer forward per tick; up to `max_running` hold state (the batch plus
requests preempted by more urgent ones, lower `priority` first).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, Never, TypeAlias, TypedDict, TypeVar

import grpc
import torch

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.options import capped_option
from stagemesh.services.dit.compile import (
    BlockCompiler,
    CompileMode,
    CompileOptions,
    refuse_with_loras,
    warm_up,
)
from stagemesh.services.dit.compile import from_options as compile_from_options
from stagemesh.services.dit.lora import LoraCatalog, LoraConfig, LoraOptions, LoraUse
from stagemesh.services.dit.lora_slots import SlotBank
from stagemesh.services.dit.lora_updates import LoraRefused, LoraUpdates, updates_off
from stagemesh.services.dit.parallel import (
    Degrees,
    Family,
    GroupDevices,
    GroupForward,
    ParallelOptions,
    QwenImageFamily,
    WanFamily,
    Workers,
    start_group,
)
from stagemesh.services.dit.preview import (
    DEFAULT_PREVIEW_SIZE,
    MAX_PREVIEW_SIZE,
    MIN_PREVIEW_EVERY,
    Painter,
    Preview,
    PreviewOptions,
)
from stagemesh.services.dit.preview_decode import PainterChoice, PreviewStageOptions, painter_choice
from stagemesh.services.dit.qwen_image_adapter import (
    CPU_DTYPE,
    DenoiseAdapter,
    DenoiseInput,
    DenoiseState,
    DitLimits,
)
from stagemesh.services.dit.step_cache import (
    StepCacheConfig,
    StepCacheOptions,
    check_capacity,
)
from stagemesh.services.dit.types import DenoisedLatents
from stagemesh.services.dit.wan_adapter import (
    VideoDenoiseInput,
    VideoDenoiseState,
    WanDenoiseAdapter,
)
from stagemesh.services.folders import folder_class
from stagemesh.services.registry import DIFFUSION_FAMILIES, WAN, ModelFamily, served_family
from stagemesh.shared.devices import DeviceOptions, Placement, resolve_placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    ExecutionMode,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepBudget,
)
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.scheduler import (
    BURST_ADMISSION_WINDOW_SECONDS,
    resolve_total_steps,
)
from stagemesh.shared.errors import abort_with
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2_grpc
from stagemesh.shared.proto.v1 import dit_service_pb2 as pb
from stagemesh.shared.quantization import Quantization, QuantizationOptions, quantize
from stagemesh.shared.quantization import from_options as quantization_from_options
from stagemesh.shared.stage_runtime import StageBundle, servicer_bundle, stage_description
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.tensors import array_to_proto
from stagemesh.shared.torch_tensors import from_proto, optional_from_proto, to_proto

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DitService"].full_name

MODES = {common_pb2.EXECUTION_MODE_STEP: ExecutionMode.STEP,
         common_pb2.EXECUTION_MODE_REQUEST: ExecutionMode.REQUEST}
MODE_TO_PROTO = {mode: value for value, mode in MODES.items()}

InputT = TypeVar("InputT")
StateT = TypeVar("StateT")
RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
DitEngine: TypeAlias = StepEngine[
    DenoiseInput, NoStream, DenoiseState, Preview, DenoisedLatents
]
VideoEngine: TypeAlias = StepEngine[
    VideoDenoiseInput, NoStream, VideoDenoiseState, Preview, DenoisedLatents
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


class DitModeOptions(StepCacheOptions, LoraOptions, QuantizationOptions, CompileOptions,
                     ParallelOptions, PreviewStageOptions, total=False):
    """How the stage runs a request by default (step execution unless set false), its step
    cache (`StepCacheOptions`: off unless set), its LoRA adapters (`LoraOptions`: none unless
    `lora_dir` is set), weight quantization and compilation of its blocks (none and off unless
    set), its parallel group (`ParallelOptions`: one device unless set), what paints its step
    previews (`PreviewStageOptions`: the projection unless set)."""

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


class VideoLimitOptions(TypedDict, total=False):
    """A Wan model's limits: WanDenoiseAdapter's keyword arguments (each capped by the model).
    max_true_cfg_scale bounds guidance_scale and guidance_scale_2."""

    max_steps: int
    max_pixels: int
    max_side: int
    max_true_cfg_scale: float
    max_frames: int
    max_video_pixels: int  # num_frames x height x width


class AnyLimitOptions(DitLimitOptions, VideoLimitOptions, total=False):
    """Every limit any DiT model takes: what the options are checked against before the
    folder (which decides the model, and so which limits apply) is read."""


def _embeddings(start: pb.DenoiseStart) -> PromptEmbeddings:
    return PromptEmbeddings(
        prompt_embeds=from_proto(start.prompt_embeds),
        prompt_embeds_mask=optional_from_proto(start.prompt_embeds_mask),
        negative_prompt_embeds=optional_from_proto(start.negative_prompt_embeds),
        negative_prompt_embeds_mask=optional_from_proto(start.negative_prompt_embeds_mask))


def _engine_request(start: pb.DenoiseStart, deadline: float | None, total: int | None,
                    payload: InputT) -> EngineRequest[InputT]:
    if start.execution_mode not in (common_pb2.EXECUTION_MODE_UNSPECIFIED, *MODES):
        raise InvalidInputError("execution_mode",
                                f"unknown execution_mode {start.execution_mode}")
    return EngineRequest(
        request_id=start.request_id, deadline=deadline, mode=MODES.get(start.execution_mode),
        budget=StepBudget(total_steps=total if total is not None else 0), priority=start.priority,
        payload=payload)


#: DenoiseStart's `optional` fields (set or not, whatever the value): only a video model's.
OptionalField: TypeAlias = Literal["guidance_scale_2", "boundary_ratio", "flow_shift"]
OPTIONAL_FIELDS: tuple[OptionalField, ...] = ("guidance_scale_2", "boundary_ratio", "flow_shift")


def _optional(start: pb.DenoiseStart, name: OptionalField) -> float | None:
    return float(getattr(start, name)) if start.HasField(name) else None


def _refuse_video_fields(start: pb.DenoiseStart) -> None:
    """An image model takes no frames, second transformer or flow shift."""
    if start.num_frames:
        raise InvalidInputError("num_frames", "num_frames: this is an image model")
    for name in OPTIONAL_FIELDS:
        if start.HasField(name):
            raise InvalidInputError(name, f"{name}: this is an image model")


def _condition_latents(start: pb.DenoiseStart) -> tuple[torch.Tensor, ...]:
    """Decoded (the message size bounds them; the adapter checks how many its model takes)."""
    return tuple(from_proto(latents) for latents in start.condition_latents)


def _request(message: pb.DenoiseRequest, deadline: float | None) -> EngineRequest[DenoiseInput]:
    """An image model's request (Qwen-Image, Qwen-Image-Edit)."""
    start = message.start
    _refuse_video_fields(start)
    sigmas = list(start.sigmas) or None
    total = resolve_total_steps(None, sigmas, start.num_inference_steps)
    payload = DenoiseInput(embeddings=_embeddings(start), height=start.height, width=start.width,
                           num_inference_steps=start.num_inference_steps,
                           true_cfg_scale=start.true_cfg_scale, seed=start.seed, sigmas=sigmas,
                           condition_latents=_condition_latents(start),
                           step_cache_threshold=_threshold(start),
                           preview=_preview_options(start), lora=_lora(start))
    return _engine_request(start, deadline, total, payload)


def _video_request(message: pb.DenoiseRequest,
                   deadline: float | None) -> EngineRequest[VideoDenoiseInput]:
    """A Wan model's request: true_cfg_scale is the pipeline's guidance_scale; the optional
    fields stay None when unset (the model's own boundary, shift, guidance_scale_2)."""
    start = message.start
    if start.sigmas:
        raise InvalidInputError("sigmas", "a Wan model takes num_inference_steps, not sigmas")
    payload = VideoDenoiseInput(
        embeddings=_embeddings(start), height=start.height, width=start.width,
        num_frames=start.num_frames, num_inference_steps=start.num_inference_steps,
        guidance_scale=start.true_cfg_scale, seed=start.seed,
        condition_latents=_condition_latents(start),
        guidance_scale_2=_optional(start, "guidance_scale_2"),
        boundary_ratio=_optional(start, "boundary_ratio"),
        flow_shift=_optional(start, "flow_shift"), step_cache_threshold=_threshold(start),
        preview=_preview_options(start), lora=_lora(start))
    return _engine_request(start, deadline, start.num_inference_steps, payload)


def _preview_options(start: pb.DenoiseStart) -> PreviewOptions | None:
    """The request's preview options; None (unset or every 0) = no previews."""
    if start.preview.every == 0:
        return None
    return PreviewOptions(every=start.preview.every,
                          size=start.preview.size or DEFAULT_PREVIEW_SIZE)


def _threshold(start: pb.DenoiseStart) -> float | None:
    """The request's step_cache_threshold; None (unset) = the stage's setting."""
    return start.step_cache_threshold if start.HasField("step_cache_threshold") else None


def _lora(start: pb.DenoiseStart) -> tuple[LoraUse, ...]:
    """The request's adapters; a scale left unset is 1.0 (diffusers' set_adapters default)."""
    return tuple(LoraUse(use.name, use.scale if use.HasField("scale") else 1.0)
                 for use in start.lora)


def _result(latents: DenoisedLatents) -> pb.DenoiseResult:
    return pb.DenoiseResult(latents=to_proto(latents.latents), height=latents.height,
                            width=latents.width, num_frames=latents.num_frames)


def _preview(preview: Preview) -> pb.DenoiseResponse:
    height, width = preview.pixels.shape[:2]
    return pb.DenoiseResponse(preview=common_pb2.Preview(
        step_index=preview.step_index, pixels=array_to_proto(preview.pixels), width=width,
        height=height))


DenoiseWire: TypeAlias = StageWire[pb.DenoiseRequest, pb.DenoiseResponse, InputT, NoStream,
                                   Preview, DenoisedLatents]
WIRE: DenoiseWire[DenoiseInput] = StageWire(
    response_cls=pb.DenoiseResponse, make_request=_request, encode_result=_result,
    encode_partial=_preview)
VIDEO_WIRE: DenoiseWire[VideoDenoiseInput] = StageWire(
    response_cls=pb.DenoiseResponse, make_request=_video_request, encode_result=_result,
    encode_partial=_preview)


class DitServicer(dit_service_pb2_grpc.DitServiceServicer, Generic[InputT, StateT]):
    def __init__(
        self, engine: StepEngine[InputT, NoStream, StateT, Preview, DenoisedLatents],
        wire: DenoiseWire[InputT], description: pb.DescribeDitResponse,
        lora_updates: LoraUpdates | None = None,
    ) -> None:
        self.engine = engine
        self.wire = wire
        self.description = description
        self.lora_updates = lora_updates  # None: runtime_lora_updates is off

    async def Denoise(
        self,
        request_iterator: AsyncIterator[pb.DenoiseRequest],
        context: grpc.aio.ServicerContext[pb.DenoiseRequest, pb.DenoiseResponse],
    ) -> AsyncIterator[pb.DenoiseResponse]:
        async for response in serve_stage_stream(self.engine, self.wire, request_iterator,
                                                 context):
            yield response

    async def DescribeDit(
        self,
        request: pb.DescribeDitRequest,
        context: grpc.aio.ServicerContext[pb.DescribeDitRequest, pb.DescribeDitResponse],
    ) -> pb.DescribeDitResponse:
        return self.description

    async def LoadLoraAdapter(
        self,
        request: pb.LoadLoraAdapterRequest,
        context: grpc.aio.ServicerContext[pb.LoadLoraAdapterRequest, pb.LoadLoraAdapterResponse],
    ) -> pb.LoadLoraAdapterResponse:
        try:
            updates = self._updates()
            added = await updates.load(request.lora_name, request.lora_path)
        except LoraRefused as refused:
            await _refuse(context, refused)
        return pb.LoadLoraAdapterResponse(added=added, lora_names=updates.names)

    async def UnloadLoraAdapter(
        self,
        request: pb.UnloadLoraAdapterRequest,
        context: grpc.aio.ServicerContext[
            pb.UnloadLoraAdapterRequest, pb.UnloadLoraAdapterResponse],
    ) -> pb.UnloadLoraAdapterResponse:
        try:
            updates = self._updates()
            await updates.unload(request.lora_name)
        except LoraRefused as refused:
            await _refuse(context, refused)
        return pb.UnloadLoraAdapterResponse(lora_names=updates.names)

    def _updates(self) -> LoraUpdates:
        if self.lora_updates is None:
            raise updates_off()
        return self.lora_updates


async def _refuse(context: grpc.aio.ServicerContext[RequestT, ResponseT],
                  refused: LoraRefused) -> Never:
    await abort_with(context, refused.code, refused.message, reason=refused.reason,
                     field_name=refused.field_name)


@dataclass(frozen=True)
class CacheFacts:
    """The step cache a DiT stage runs, what a guided request's cache holds at most, and how
    its blocks are quantized and compiled."""

    config: StepCacheConfig
    bytes_per_row: int
    quantization: Quantization = Quantization.NONE
    compile: CompileMode = CompileMode.OFF


#: A stage without a step cache.
NO_CACHE = CacheFacts(StepCacheConfig(), 0)
#: A stage that is no group.
ONE_DEVICE = Degrees()
#: A stage without LoRA adapters.
NO_LORAS = LoraCatalog(LoraConfig())


def _describe(
    model_dir: Path, engine: StepEngine[InputT, NoStream, StateT, Preview, DenoisedLatents],
    limits: DitLimits, mode: ExecutionMode, placement: Placement, request_mode: bool = False,
    cache: CacheFacts = NO_CACHE, loras: LoraCatalog = NO_LORAS, previews: bool = False,
    degrees: Degrees = ONE_DEVICE,
) -> pb.DescribeDitResponse:
    """The stage's facts; execution_modes lists the default mode first, and REQUEST only
    when it is the default or the `request_mode` option allows it."""
    config = cache.config
    modes = [mode, *(other for other in ExecutionMode
                     if other is not mode and (other is not ExecutionMode.REQUEST
                                               or request_mode))]
    description = pb.DescribeDitResponse(
        stage=stage_description("dit", model_dir, engine, placement),
        size_multiple=limits.size_multiple, max_side=limits.max_side,
        max_pixels=limits.max_pixels, max_steps=limits.max_steps, min_steps=limits.min_steps,
        max_true_cfg_scale=limits.max_true_cfg_scale,
        max_images_per_request=limits.max_images_per_request,
        execution_modes=[MODE_TO_PROTO[other] for other in modes],
        max_frames=limits.max_frames, frame_multiple=limits.frame_multiple,
        frame_patch=limits.frame_patch,
        max_condition_images=limits.max_condition_images,
        has_second_transformer=limits.has_second_transformer,
        accepts_flow_shift=limits.accepts_flow_shift, task=limits.task,
        max_video_pixels=limits.max_video_pixels, step_cache=config.method.value,
        step_cache_threshold=config.request_threshold(None),
        step_cache_interval=config.interval, step_cache_warmup_steps=config.warmup_steps,
        step_cache_final_steps=config.final_steps, step_cache_max_skips=config.max_skips,
        max_step_cache_threshold=config.published_max_threshold,
        step_cache_bytes_per_row=cache.bytes_per_row, quantization=cache.quantization.value,
        compile=cache.compile.value,
        max_preview_size=MAX_PREVIEW_SIZE if previews else 0,
        default_preview_size=DEFAULT_PREVIEW_SIZE if previews else 0,
        min_preview_every=MIN_PREVIEW_EVERY if previews else 0,
        parallel_cfg=degrees.cfg, parallel_ulysses=degrees.ulysses,
        group_devices=GroupDevices.named(placement.device).names(degrees))
    _describe_loras(description, loras)
    return description


def _describe_loras(description: pb.DescribeDitResponse, loras: LoraCatalog) -> None:
    """Describe's LoRA fields: the names a request may use, the limits it is checked by (all
    zero when the stage serves none)."""
    lora = loras.config
    if not lora.enabled:
        return
    description.lora_names.extend(loras.names)
    description.max_loras, description.max_lora_rank = lora.max_loras, lora.max_lora_rank
    description.max_loras_per_request = lora.max_loras_per_request
    description.max_lora_scale = lora.max_lora_scale
    description.runtime_lora_updates = lora.runtime_updates


def admission_window_seconds(options: DitEngineOptions) -> float:
    """The `admission_window_ms` option (default DEFAULT_ADMISSION_WINDOW_MS), in seconds."""
    window = options.get("admission_window_ms", DEFAULT_ADMISSION_WINDOW_MS)
    if not 0 <= window <= MAX_ADMISSION_WINDOW_MS:
        raise ValueError(f"option admission_window_ms must be in [0, {MAX_ADMISSION_WINDOW_MS}], "
                         f"got {window}")
    return window / 1000


def pipeline_family(model_dir: Path) -> ModelFamily:
    """The folder's family (services.registry): it picks the adapter. Qwen-Image folders run
    on DenoiseAdapter, Wan ones on WanDenoiseAdapter."""
    return served_family("dit", model_dir, DIFFUSION_FAMILIES)


def pipeline_class(model_dir: Path) -> str:
    """The diffusers pipeline class the folder names, one the stage serves."""
    pipeline_family(model_dir)
    return str(folder_class(model_dir))


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """options: DitModeOptions, DitEngineOptions (max_batch 8, max_running 16, admission window
    20 ms by default), DeviceOptions, and the model's limits: DitLimitOptions for a Qwen-Image
    folder, VideoLimitOptions for a Wan folder."""
    # a bad key, device or dtype fails before the model folder is read
    first_options, *_, device_options = parse_options(
        "dit", options, DitModeOptions, DitEngineOptions, AnyLimitOptions, DeviceOptions)
    quantization = quantization_from_options(
        "dit", first_options, resolve_placement("dit", device_options, CPU_DTYPE).device)
    cache = StepCacheConfig.from_options(first_options)
    lora = LoraConfig.from_options(first_options)
    compile_mode = compile_from_options(first_options)
    degrees = Degrees.from_options(first_options)
    if degrees.world > 1:
        _check_group(first_options, device_options)
    painter = painter_choice(first_options)
    refuse_with_loras(compile_mode, lora.enabled)
    if pipeline_family(model_dir).name == WAN:
        mode_options, engine_options, _, device_options = parse_options(
            "dit", options, DitModeOptions, DitEngineOptions, VideoLimitOptions, DeviceOptions)
        placement = resolve_placement("dit", device_options, CPU_DTYPE)
        video = video_adapter(model_dir, options, painter)
        video.group, workers = _group(WanFamily(video.transformers), model_dir, options, degrees)
        _accelerate(video, [block for t in video.transformers for block in t.blocks],
                    quantization, compile_mode)
        return _bundle(model_dir, video, video.limits, VIDEO_WIRE, mode_options, engine_options,
                       placement, CacheFacts(cache, video.step_cache_bytes_per_row(),
                                             quantization, compile_mode), video.loras,
                       video.lora_slots, painter=video.painter, degrees=degrees,
                       workers=workers)
    mode_options, engine_options, _, device_options = parse_options(
        "dit", options, DitModeOptions, DitEngineOptions, DitLimitOptions, DeviceOptions)
    placement = resolve_placement("dit", device_options, CPU_DTYPE)
    image = image_adapter(model_dir, options, painter)
    image.group, workers = _group(QwenImageFamily(image.transformer), model_dir, options, degrees)
    _accelerate(image, list(image.transformer.transformer_blocks), quantization, compile_mode)
    return _bundle(model_dir, image, image.limits, WIRE, mode_options, engine_options, placement,
                   CacheFacts(cache, image.step_cache_bytes_per_row(), quantization,
                              compile_mode), image.loras, image.lora_slots,
                   painter=image.painter, degrees=degrees, workers=workers)


@dataclass(frozen=True)
class _Shared:
    """What both adapters take besides their limits, from the options."""

    placement: Placement
    step_cache: StepCacheConfig
    lora: LoraConfig


LimitsT = TypeVar("LimitsT", DitLimitOptions, VideoLimitOptions)


def _read(options: Mapping[str, object], limits: type[LimitsT]) -> tuple[LimitsT, _Shared]:
    mode, _, limit_options, device = parse_options(
        "dit", options, DitModeOptions, DitEngineOptions, limits, DeviceOptions)
    return limit_options, _Shared(resolve_placement("dit", device, CPU_DTYPE),
                                  StepCacheConfig.from_options(mode), LoraConfig.from_options(mode))


def image_adapter(model_dir: Path, options: Mapping[str, object],
                  painter: PainterChoice = PainterChoice.PROJECTION) -> DenoiseAdapter:
    """A Qwen-Image folder's adapter as the options describe it."""
    limits, shared = _read(options, DitLimitOptions)
    return DenoiseAdapter(model_dir, **limits, placement=shared.placement,
                          step_cache=shared.step_cache, lora=shared.lora, preview_painter=painter)


def video_adapter(model_dir: Path, options: Mapping[str, object],
                  painter: PainterChoice = PainterChoice.PROJECTION) -> WanDenoiseAdapter:
    """A Wan folder's adapter as the options describe it."""
    limits, shared = _read(options, VideoLimitOptions)
    return WanDenoiseAdapter(model_dir, **limits, placement=shared.placement,
                             step_cache=shared.step_cache, lora=shared.lora,
                             preview_painter=painter)


def group_family(model_dir: Path | str,
                 options: Mapping[str, object]) -> tuple[Family, Degrees]:
    """What a worker rank of a group builds (`services/dit/parallel_worker.py`,
    `parallel.STAGE_BUILDER`): the same transformers as rank 0, quantized as rank 0 quantizes
    its own (`_accelerate`), and the group's degrees."""
    model_dir = Path(model_dir)
    mode_options, *_, device_options = parse_options(
        "dit", options, DitModeOptions, DitEngineOptions, AnyLimitOptions, DeviceOptions)
    degrees = Degrees.from_options(mode_options)
    family: Family = (
        WanFamily(video_adapter(model_dir, options).transformers)
        if pipeline_family(model_dir).name == WAN
        else QwenImageFamily(image_adapter(model_dir, options).transformer))
    quantize([block for model in range(len(family.transformers))
              for block in family.blocks(model)],
             quantization_from_options(
                 "dit", mode_options, resolve_placement("dit", device_options, CPU_DTYPE).device))
    return family, degrees


def _group(family: Family, model_dir: Path, options: Mapping[str, object],
           degrees: Degrees) -> tuple[GroupForward | None, Workers | None]:
    """Rank 0's group over `family` (None, None for one device)."""
    if degrees.world == 1:
        return None, None
    return start_group(family, model_dir, options, degrees)


def _check_group(options: DitModeOptions, device: DeviceOptions) -> None:
    """What a parallel group does not run yet: a ValueError naming it (a device a group cannot
    span, before the model is read)."""
    if "device" in device:
        GroupDevices.named(device["device"])
    if compile_from_options(options) is not CompileMode.OFF:
        raise ValueError("stage dit: parallel_cfg/parallel_ulysses cannot be combined with "
                         "compile yet")


def _accelerate(adapter: DenoiseAdapter | WanDenoiseAdapter, blocks: list[torch.nn.Module],
                quantization: Quantization, compile_mode: CompileMode) -> None:
    """Quantize the transformer blocks, then compile them and warm them up (quantized weights
    are what the graphs compute with)."""
    quantize(blocks, quantization)
    if compile_mode is CompileMode.BLOCKS:
        compiler = BlockCompiler()
        compiler.compile(blocks)
        warm_up(adapter, compiler)


def _bundle(
    model_dir: Path, adapter: StageAdapter[InputT, NoStream, StateT, Preview, DenoisedLatents],
    limits: DitLimits, wire: DenoiseWire[InputT], mode_options: DitModeOptions,
    engine_options: DitEngineOptions, placement: Placement, cache: CacheFacts,
    loras: LoraCatalog = NO_LORAS, lora_slots: SlotBank | None = None,
    painter: Painter | None = None, degrees: Degrees = ONE_DEVICE, workers: Workers | None = None,
) -> StageBundle:
    """The engine over `adapter`, its servicer and the stage bundle (any DiT model); every
    running request's step cache must fit (`check_capacity`). A group's `workers` are watched:
    one that ends stops the engine (its requests abort, reason SHUTDOWN; the runtime turns
    NOT_SERVING and exits, and its supervisor restarts the whole group)."""
    step_execution = mode_options.get("step_execution", True)
    mode = ExecutionMode.STEP if step_execution else ExecutionMode.REQUEST
    engine = StepEngine(
        adapter, mode=mode,
        max_running=capped_option(
            "max_running", engine_options.get("max_running", DEFAULT_MAX_RUNNING)),
        max_batch=capped_option("max_batch", engine_options.get("max_batch", DEFAULT_MAX_BATCH)),
        admission_window=admission_window_seconds(engine_options))
    check_capacity(cache.bytes_per_row, engine.max_running, placement.device)
    if workers is not None:
        workers.watch(lambda reason: _group_fault(engine, workers, reason))
    description = _describe(
        model_dir, engine, limits, mode, placement, mode_options.get("request_mode", False),
        cache, loras, painter is not None, degrees)
    updates = (LoraUpdates(loras, lora_slots, description)
               if loras.config.runtime_updates and lora_slots is not None else None)
    servicer = DitServicer(engine, wire, description, updates)
    return servicer_bundle("dit", model_dir, [engine], servicer,
                           dit_service_pb2_grpc.add_DitServiceServicer_to_server, SERVICE_NAME,
                           {**placement.facts(), "mode": mode.value,
                            "max_batch": str(engine.max_batch),
                            "step_cache": cache.config.method.value,
                            "quantization": cache.quantization.value,
                            "compile": cache.compile.value,
                            "preview_painter": painter.name if painter else "none",
                            "parallel": f"cfg={degrees.cfg} ulysses={degrees.ulysses}",
                            **({"group_pids": " ".join(map(str, workers.pids))}
                               if workers else {})})


def _group_fault(engine: StepEngine[InputT, NoStream, StateT, Preview, DenoisedLatents],
                 workers: Workers, reason: str) -> None:
    """A rank died: the group fails as one. The engine stops (its requests abort, reason
    SHUTDOWN: UNAVAILABLE at the gateway), the other workers end, and the stage runtime turns
    NOT_SERVING and exits 1 so that `serve` (or Kubernetes) starts the whole group again."""
    log.error("stage dit: group fault (%s); stopping so that the group is restarted", reason)
    engine.shutdown(abort_running=True, timeout=0)  # aborts at the step boundary
    workers.stop()
