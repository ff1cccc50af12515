"""Videos on the gateway core, for every transport: prepare (recipe, the stages' facts, every
field checked, an input image decoded) and run inside the request's CancelScope, as a whole
MP4 (POST /v1/videos/sync) or into a job's sink (jobs.py).

The stage composition itself is pipeline.py (make_video).
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.recipes import VIDEO_TASKS, Recipe, Task
from stagemesh.gateway.videos import pipeline
from stagemesh.gateway.videos.mux import Mp4Writer, check_encoder
from stagemesh.gateway.videos.pipeline import FrameSink, Mp4Sink, OnProgress, VideoSummary
from stagemesh.gateway.videos.protocol import VideoParams, VideoRequest, resolve_video_request


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
                     sink: FrameSink, on_progress: OnProgress) -> VideoSummary:
    async with core.request_scope(spec.recipe, context) as scope:
        return await pipeline.make_video(spec.params, scope, core.mesh.image_stubs(spec.recipe),
                                         sink, on_progress)


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
