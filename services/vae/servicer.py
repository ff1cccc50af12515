"""VAE stage servicer: DecodeLatents and EncodeImage, each on its own engine, and DescribeVae.

The folder's family (`services.registry`) picks the adapters:

- Qwen-Image, Qwen-Image-Edit (AutoencoderKLQwenImage): DecodeLatents decodes images in one
  batched step (`qwen_image_adapter.LatentDecoderAdapter`); a `num_frames` is refused.
- Wan video (AutoencoderKLWan): DecodeLatents decodes a video chunk by chunk and streams its
  frames (`video.VideoDecoderAdapter`); `num_frames` is required.

Both encode images (`encode.ImageEncoderAdapter`, as their stock pipelines do).

Two engines, not one engine with two request kinds: each RPC keeps its own step boundaries
(an encode's chunks and a decode's chunks are each a step, aborted between them) with no union
of states in one adapter, and an edit's encode, on the critical path of its request, never queues
behind the chunks of a long video decode. Both share the one loaded model: the encoder adapter
uses only `encoder` and `quant_conv`, the decoders only `post_quant_conv` and `decoder` (and the
Qwen image decode, as today, `vae.decode`), and every feature cache lives in a request state.
Metrics label them `vae` and `vae-encode`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TypeAlias

import grpc
import torch

from stagemesh.models.families.qwen_image import condition_area
from stagemesh.models.families.wan import WanGeometry
from stagemesh.services.registry import DIFFUSION_FAMILIES, WAN, served_family
from stagemesh.services.vae.encode import MAX_SOURCE_PIXELS, EncodeInput, ImageEncoderAdapter
from stagemesh.services.vae.kinds import (
    QwenEditEncoding,
    WanI2VEncoding,
    load_wan_vae,
)
from stagemesh.services.vae.limits import VaeLimits
from stagemesh.services.vae.qwen_image_adapter import (
    CPU_DTYPE,
    DEFAULT_MAX_RUNNING,
    DecodedImages,
    LatentDecoderAdapter,
    LatentsInput,
)
from stagemesh.services.vae.video import (
    DEFAULT_VIDEO_MAX_RUNNING,
    WAN_CPU_DTYPE,
    DecodedFrames,
    DecodedVideo,
    VideoDecoderAdapter,
    VideoLatentsInput,
    VideoOptions,
)
from stagemesh.shared.devices import DeviceOptions, Placement, resolve_placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
)
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.scheduler import BURST_ADMISSION_WINDOW_SECONDS
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import vae_service_pb2 as pb
from stagemesh.shared.proto.v1 import vae_service_pb2_grpc
from stagemesh.shared.stage_runtime import (
    StageBundle,
    StageEngine,
    servicer_bundle,
    stage_description,
)
from stagemesh.shared.stage_stream import StageRoute, StageWire, StreamHandler
from stagemesh.shared.torch_tensors import from_proto, to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VaeService"].full_name

#: Encodes that hold a feature cache at once; each steps alone, so more only interleaves them.
DEFAULT_ENCODE_MAX_RUNNING = 4

DecodeHandler: TypeAlias = StreamHandler[pb.DecodeLatentsRequest, pb.DecodeLatentsResponse]


# -- DecodeLatents, images (Qwen-Image) -----------------------------------------------------


def _image_request(
    message: pb.DecodeLatentsRequest, deadline: float | None
) -> EngineRequest[LatentsInput]:
    start = message.start
    if start.num_frames != 0:
        raise InvalidInputError(
            "num_frames", f"this VAE decodes images only (max_frames 0), got {start.num_frames} "
            "frames")
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        payload=LatentsInput(latents=from_proto(start.latents), height=start.height,
                             width=start.width))


def _image_result(decoded: DecodedImages) -> pb.DecodeLatentsResult:
    return pb.DecodeLatentsResult(pixels=to_proto(torch.from_numpy(decoded.pixels)))


WIRE: StageWire[pb.DecodeLatentsRequest, pb.DecodeLatentsResponse, LatentsInput, NoStream,
                NoStream, DecodedImages] = StageWire(
    response_cls=pb.DecodeLatentsResponse, make_request=_image_request,
    encode_result=_image_result)


# -- DecodeLatents, video (Wan) -------------------------------------------------------------


def video_wire(adapter: VideoDecoderAdapter) -> StageWire[
    pb.DecodeLatentsRequest, pb.DecodeLatentsResponse, VideoLatentsInput, NoStream,
    DecodedFrames, DecodedVideo,
]:
    """DecodeLatents for video: one request step per chunk, a `frames` event per step."""

    def make_request(message: pb.DecodeLatentsRequest,
                     deadline: float | None) -> EngineRequest[VideoLatentsInput]:
        start = message.start
        payload = VideoLatentsInput(latents=from_proto(start.latents), height=start.height,
                                    width=start.width, num_frames=start.num_frames)
        return EngineRequest(request_id=start.request_id, payload=payload,
                             budget=adapter.budget(payload), deadline=deadline)

    def encode_partial(frames: DecodedFrames) -> pb.DecodeLatentsResponse:
        return pb.DecodeLatentsResponse(frames=pb.DecodedFrames(
            pixels=to_proto(torch.from_numpy(frames.pixels)),
            first_frame_index=frames.first_frame_index))

    def encode_result(video: DecodedVideo) -> pb.DecodeLatentsResult:
        return pb.DecodeLatentsResult(num_frames=video.num_frames)  # the frames came before

    return StageWire(response_cls=pb.DecodeLatentsResponse, make_request=make_request,
                     encode_result=encode_result, encode_partial=encode_partial)


# -- EncodeImage ----------------------------------------------------------------------------


def encode_wire(adapter: ImageEncoderAdapter) -> StageWire[
    pb.EncodeImageRequest, pb.EncodeImageResponse, EncodeInput, NoStream, NoStream,
    torch.Tensor,
]:
    """EncodeImage: one request step per encoder chunk (a `progress` event each)."""

    def make_request(message: pb.EncodeImageRequest,
                     deadline: float | None) -> EngineRequest[EncodeInput]:
        start = message.start
        image = from_proto(start.image, max_elements=MAX_SOURCE_PIXELS * 3)
        payload = EncodeInput(image=image, height=start.height, width=start.width,
                              num_frames=start.num_frames)
        return EngineRequest(request_id=start.request_id, payload=payload,
                             budget=adapter.budget(payload), deadline=deadline)

    def encode_result(latents: torch.Tensor) -> pb.EncodeImageResult:
        return pb.EncodeImageResult(latents=to_proto(latents))

    return StageWire(response_cls=pb.EncodeImageResponse, make_request=make_request,
                     encode_result=encode_result)


# -- the servicer ---------------------------------------------------------------------------


class VaeServicer(vae_service_pb2_grpc.VaeServiceServicer):
    def __init__(
        self,
        decode: StreamHandler[pb.DecodeLatentsRequest, pb.DecodeLatentsResponse],
        encode: StreamHandler[pb.EncodeImageRequest, pb.EncodeImageResponse],
        description: pb.DescribeVaeResponse,
    ) -> None:
        self.decode = decode
        self.encode = encode
        self.description = description

    async def DecodeLatents(
        self,
        request_iterator: AsyncIterator[pb.DecodeLatentsRequest],
        context: grpc.aio.ServicerContext[pb.DecodeLatentsRequest, pb.DecodeLatentsResponse],
    ) -> AsyncIterator[pb.DecodeLatentsResponse]:
        async for response in self.decode(request_iterator, context):
            yield response

    async def EncodeImage(
        self,
        request_iterator: AsyncIterator[pb.EncodeImageRequest],
        context: grpc.aio.ServicerContext[pb.EncodeImageRequest, pb.EncodeImageResponse],
    ) -> AsyncIterator[pb.EncodeImageResponse]:
        async for response in self.encode(request_iterator, context):
            yield response

    async def DescribeVae(
        self,
        request: pb.DescribeVaeRequest,
        context: grpc.aio.ServicerContext[pb.DescribeVaeRequest, pb.DescribeVaeResponse],
    ) -> pb.DescribeVaeResponse:
        return self.description


# -- building the stage ---------------------------------------------------------------------


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """The VAE stage of the folder's VAE (see the module docstring). Options: a Qwen-Image
    VAE takes DeviceOptions only; a Wan VAE DeviceOptions, `max_running` (video decodes at
    once, default 2) and VideoOptions (`decode_chunk_frames`, default 4 latent frames per
    step; `max_frames`, default 121). Any other key is refused, before the folder is read."""
    # any VAE's keys, and where it computes, checked before the folder is read
    *_, device_options = parse_options("vae", options, EngineOptions, VideoOptions, DeviceOptions)
    resolve_placement("vae", device_options, CPU_DTYPE)
    if served_family("vae", model_dir, DIFFUSION_FAMILIES).name == WAN:
        return _build_wan(model_dir, options)
    return _build_qwen_image(model_dir, options)


def _build_qwen_image(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    placement = resolve_placement("vae", parse_options("vae", options, DeviceOptions), CPU_DTYPE)
    decoder = LatentDecoderAdapter(model_dir, placement=placement)
    engine = StepEngine(decoder, max_running=DEFAULT_MAX_RUNNING,
                        admission_window=BURST_ADMISSION_WINDOW_SECONDS)
    encoding = QwenEditEncoding.of(decoder.vae, decoder.latent_factor, condition_area(model_dir))
    encoder = ImageEncoderAdapter(decoder.vae, encoding, decoder.limits, placement)
    return _bundle(model_dir, placement, decoder.limits, engine, StageRoute(engine, WIRE), encoder,
                   condition_area=encoding.area)


def _build_wan(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    engine_options, video_options, device_options = parse_options(
        "vae", options, EngineOptions, VideoOptions, DeviceOptions)
    placement = resolve_placement("vae", device_options, WAN_CPU_DTYPE)
    vae, geometry = load_wan_vae(model_dir, placement), WanGeometry.from_folder(model_dir)
    decoder = VideoDecoderAdapter(vae, geometry, placement=placement, **video_options)
    engine = StepEngine(decoder, max_running=engine_options.get(
        "max_running", DEFAULT_VIDEO_MAX_RUNNING))
    encoder = ImageEncoderAdapter(vae, WanI2VEncoding.of(geometry), decoder.limits, placement)
    bundle = _bundle(model_dir, placement, decoder.limits, engine,
                     StageRoute(engine, video_wire(decoder)), encoder)
    bundle.info["decode_chunk_frames"] = str(decoder.decode_chunk_frames)
    return bundle


def _bundle(
    model_dir: Path,
    placement: Placement,
    limits: VaeLimits,
    decode_engine: StageEngine,
    decode: DecodeHandler,
    encoder: ImageEncoderAdapter,
    condition_area: int = 0,
) -> StageBundle:
    """The stage from its decode route and its encoder: the encode engine, Describe, bundle.
    `condition_area`: what an edit's input image is encoded at (0: the size asked)."""
    encode_engine = StepEngine(encoder, max_running=DEFAULT_ENCODE_MAX_RUNNING)
    description = pb.DescribeVaeResponse(
        stage=stage_description("vae", model_dir, decode_engine, placement),
        size_multiple=limits.size_multiple, max_side=limits.max_side, can_encode=True,
        max_frames=limits.max_frames, condition_area=condition_area)
    servicer = VaeServicer(decode, StageRoute(encode_engine, encode_wire(encoder)), description)
    return servicer_bundle("vae", model_dir, [decode_engine, encode_engine], servicer,
                        vae_service_pb2_grpc.add_VaeServiceServicer_to_server, SERVICE_NAME,
                        {**placement.facts(), "max_frames": str(limits.max_frames)})
