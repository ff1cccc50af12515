"""Text- and image-to-video: Tokenizer (and, with an input image, VAE EncodeImage, side by side)
-> DiT (every frame at once, one step at a time) -> VAE DecodeLatents, whose frames stream back
in chunks and are muxed into an MP4 as they arrive.

A cancel (DELETE of a job, cancel by id, client gone) stops whichever stage is open at its next
step; a video stopped in the DiT never reaches the VAE. Encoding runs in a worker thread, one
chunk at a time and in order, never on the event loop.

Prepare (recipe, the stages' facts, every field checked, an input image decoded) and run
(inside the request's CancelScope: a whole MP4, or into a job's sink) are at the end, for
every transport.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.images.pipeline import png_preview, preview_options
from stagemesh.gateway.mesh.calls import CancelScope, StageCallError, call_stage, side_by_side
from stagemesh.gateway.mesh.stages import lora_to_proto
from stagemesh.gateway.mesh.stubs import ImageStubs
from stagemesh.gateway.recipes import VIDEO_TASKS, Recipe, Task
from stagemesh.gateway.videos.mux import Frames, Mp4Writer, check_encoder
from stagemesh.gateway.videos.protocol import VideoParams, VideoRequest, resolve_video_request
from stagemesh.shared.errors import StageError
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)
from stagemesh.shared.tensors import array_from_proto, array_to_proto

#: The share of a job's progress that denoising stands for; decoding the frames is the rest.
DENOISE_SHARE = 0.9

#: Told the fraction done (0 to 1) each time it grows, and the stage it comes from.
OnProgress = Callable[[str, float], Awaitable[None]]
#: Told each step preview of the middle frame (PNG), when the request asked for previews.
OnPreview = Callable[[common_pb2.Preview], Awaitable[None]]


class FrameSink(Protocol):
    """Where decoded frames go, in order (an MP4 being written)."""

    async def write(self, frames: Frames) -> None: ...


class Mp4Sink:
    """Frames -> an Mp4Writer, each chunk encoded in a worker thread (in order: one at a time)."""

    def __init__(self, writer: Mp4Writer) -> None:
        self.writer = writer

    async def write(self, frames: Frames) -> None:
        await asyncio.to_thread(self.writer.write, frames)


@dataclass(frozen=True)
class VideoSummary:
    """What was made: frames written, their size and rate, and the DiT steps run."""

    num_frames: int
    width: int
    height: int
    fps: int
    steps: int


async def _ignore(stage: str, fraction: float) -> None:
    return None


async def _ignore_preview(preview: common_pb2.Preview) -> None:
    return None


class _Tracker:
    """Turns the stages' events into the job's fraction done and writes decoded frames, checking
    that the VAE sends them in order and whole."""

    def __init__(self, params: VideoParams, sink: FrameSink, on_progress: OnProgress,
                 on_preview: OnPreview = _ignore_preview) -> None:
        self.params, self.sink, self.on_progress = params, sink, on_progress
        self.on_preview = on_preview
        self.frames_written = 0
        self.total_frames = params.num_frames

    async def dit(self, stage: str, response: dit_service_pb2.DenoiseResponse) -> None:
        event = response.WhichOneof("event")
        if event == "progress" and response.progress.total_steps > 0:
            done = response.progress.step_index / response.progress.total_steps
            await self.on_progress(stage, DENOISE_SHARE * min(1.0, done))
        elif event == "preview":
            await self.on_preview(await png_preview(response.preview))

    async def vae(self, stage: str, response: vae_service_pb2.DecodeLatentsResponse) -> None:
        if response.WhichOneof("event") != "frames":
            return
        chunk = response.frames
        if chunk.first_frame_index != self.frames_written:
            raise _broken(f"frames out of order: chunk starts at {chunk.first_frame_index}, "
                          f"{self.frames_written} written")
        frames = array_from_proto(chunk.pixels)
        expected = (self.params.height, self.params.width, 3)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != expected:
            raise _broken(f"frames must be uint8 [n, {expected[0]}, {expected[1]}, 3], got "
                          f"{frames.dtype} {list(frames.shape)}")
        if self.frames_written + frames.shape[0] > self.total_frames:
            raise _broken(f"more than the {self.total_frames} frames of the video")
        await self.sink.write(frames.astype(np.uint8, copy=False))
        self.frames_written += frames.shape[0]
        await self.on_progress(stage, DENOISE_SHARE + (1 - DENOISE_SHARE)
                               * self.frames_written / self.total_frames)


def _broken(message: str) -> StageCallError:
    return StageCallError("vae", StageError(grpc.StatusCode.INTERNAL, f"vae stage: {message}"))


async def _encode_prompt(params: VideoParams, scope: CancelScope, stubs: ImageStubs
                         ) -> tokenizer_service_pb2.EncodePromptResult:
    encoded = await call_stage(
        scope, "tokenizer", stubs.tokenizer.EncodePrompt,
        tokenizer_service_pb2.EncodePromptRequest(start=tokenizer_service_pb2.EncodePromptStart(
            request_id=scope.stage_request_id, prompt=params.prompt,
            negative_prompt=params.negative_prompt)),
        tokenizer_service_pb2.EncodePromptRequest)
    return encoded.result


async def _encode_image(params: VideoParams, scope: CancelScope, stubs: ImageStubs
                        ) -> tuple[common_pb2.Tensor, ...]:
    """Image-to-video: the first frame and its zero padding -> the DiT's condition latents."""
    if params.image is None:
        return ()
    encoded = await call_stage(
        scope, "vae", stubs.vae.EncodeImage, vae_service_pb2.EncodeImageRequest(
            start=vae_service_pb2.EncodeImageStart(
                request_id=scope.stage_request_id, image=array_to_proto(params.image),
                height=params.height, width=params.width, num_frames=params.num_frames)),
        vae_service_pb2.EncodeImageRequest)
    return (encoded.result.latents,)


def denoise_start(params: VideoParams, request_id: str,
                  encoded: tokenizer_service_pb2.EncodePromptResult,
                  condition: tuple[common_pb2.Tensor, ...]) -> dit_service_pb2.DenoiseStart:
    """The DiT's start message: the Wan 2.2 knobs only when given (unset = the model's)."""
    start = dit_service_pb2.DenoiseStart(
        request_id=request_id, prompt_embeds=encoded.prompt_embeds,
        prompt_embeds_mask=encoded.prompt_embeds_mask,
        negative_prompt_embeds=encoded.negative_prompt_embeds,
        negative_prompt_embeds_mask=encoded.negative_prompt_embeds_mask,
        height=params.height, width=params.width, num_frames=params.num_frames,
        num_inference_steps=params.num_inference_steps, true_cfg_scale=params.guidance_scale,
        seed=params.seed, condition_latents=condition, lora=lora_to_proto(params.lora))
    if params.guidance_scale_2 is not None:
        start.guidance_scale_2 = params.guidance_scale_2
    if params.boundary_ratio is not None:
        start.boundary_ratio = params.boundary_ratio
    if params.flow_shift is not None:
        start.flow_shift = params.flow_shift
    if params.step_cache_threshold is not None:
        start.step_cache_threshold = params.step_cache_threshold
    if params.preview is not None:
        start.preview.CopyFrom(preview_options(params.preview))
    return start


async def render_video(params: VideoParams, scope: CancelScope, stubs: ImageStubs,
                       sink: FrameSink, on_progress: OnProgress = _ignore,
                       on_preview: OnPreview = _ignore_preview) -> VideoSummary:
    """Run the stages for one video, writing its frames to `sink` as the VAE decodes them.

    The prompt and (image-to-video) the input image are encoded side by side; the DiT then
    denoises every frame together, and the VAE streams the decoded frames back in chunks.
    Raises what call_stage raises (RequestCancelled, StageCallError); the caller's scope turns
    them into GatewayErrors.
    """
    tracker = _Tracker(params, sink, on_progress, on_preview)
    async with side_by_side() as group:
        prompt = group.create_task(_encode_prompt(params, scope, stubs))
        image = group.create_task(_encode_image(params, scope, stubs))
    denoised = await call_stage(
        scope, "dit", stubs.dit.Denoise, dit_service_pb2.DenoiseRequest(
            start=denoise_start(params, scope.stage_request_id, prompt.result(), image.result())),
        dit_service_pb2.DenoiseRequest, on_event=tracker.dit)
    result = denoised.result
    frames = result.num_frames or params.num_frames
    tracker.total_frames = frames
    await call_stage(
        scope, "vae", stubs.vae.DecodeLatents, vae_service_pb2.DecodeLatentsRequest(
            start=vae_service_pb2.DecodeLatentsStart(
                request_id=scope.stage_request_id, latents=result.latents,
                height=params.height, width=params.width, num_frames=frames)),
        vae_service_pb2.DecodeLatentsRequest, on_event=tracker.vae)
    if tracker.frames_written != frames:
        raise _broken(f"decoded {tracker.frames_written} of the {frames} frames")
    return VideoSummary(num_frames=frames, width=params.width, height=params.height,
                        fps=params.fps, steps=result.steps)


# -- prepare + run, for every transport -----------------------------------------------------------

@dataclass(frozen=True)
class VideoSpec:
    """A checked video request and the recipe that runs it."""

    recipe: Recipe
    params: VideoParams


async def prepare_video(core: GatewayCore, request: VideoRequest) -> VideoSpec:
    """The recipe (`model`, else the default text-to-video one, or image-to-video with an
    input image) and the checked request; 503 before any stage runs when this gateway
    cannot write MP4s."""
    chosen = core.recipes.get(request.model)
    if chosen is None or chosen.task not in VIDEO_TASKS:
        chosen = core.mesh.recipe(request.model, Task.IMAGE_TO_VIDEO if request.image
                                  is not None else Task.TEXT_TO_VIDEO)
    recipe = chosen
    facts = await core.catalog.video_facts(recipe)
    # Decoding an input image is CPU work: keep it off the event loop.
    params = await asyncio.to_thread(resolve_video_request, request, recipe.video_defaults,
                                     facts)
    await asyncio.to_thread(check_encoder)
    return VideoSpec(recipe, params)


async def make_video(core: GatewayCore, spec: VideoSpec, context: RequestContext,
                     sink: FrameSink, on_progress: OnProgress,
                     on_preview: OnPreview = _ignore_preview) -> VideoSummary:
    async with core.request_scope(spec.recipe, context) as scope:
        return await render_video(spec.params, scope, core.mesh.image_stubs(spec.recipe),
                                  sink, on_progress, on_preview)


async def video_bytes(core: GatewayCore, spec: VideoSpec, context: RequestContext) -> bytes:
    """The whole MP4 of a video nobody stores (POST /v1/videos/sync), muxed in memory."""
    buffer = io.BytesIO()
    params = spec.params
    writer = await asyncio.to_thread(Mp4Writer, buffer, params.width, params.height, params.fps)

    async def ignore(stage: str, fraction: float) -> None:
        return None

    try:
        await make_video(core, spec, context, Mp4Sink(writer), ignore)
        await asyncio.to_thread(writer.close)
    except BaseException:
        await asyncio.to_thread(writer.abort)
        raise
    return buffer.getvalue()
