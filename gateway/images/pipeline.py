"""Text-to-image: Tokenizer once, then DiT -> VAE for each image (side by side), then PNG.

Image edit is the same with the input image read twice first, side by side: by the Tokenizer
(with the prompt) and by the VAE (EncodeImage, into the latents the DiT is conditioned on).

Prepare (recipe, stage facts, every field checked, input images decoded) and run (inside
the request's CancelScope) are at the end, one pair per request kind, for every transport.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from PIL import Image

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.edit_protocol import EditParams, EditRequest, resolve_edit_request
from stagemesh.gateway.images.protocol import (
    ImageParams,
    ImageRequest,
    PreviewAsk,
    resolve_image_request,
)
from stagemesh.gateway.mesh.calls import CancelScope, call_stage, side_by_side
from stagemesh.gateway.mesh.events import Done, Emit, Output, Part, StageEvent, stream_pipeline
from stagemesh.gateway.mesh.stages import lora_to_proto
from stagemesh.gateway.mesh.stubs import ImageStubs
from stagemesh.gateway.recipes import Recipe, Task
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)
from stagemesh.shared.tensors import array_from_proto, array_to_proto


@dataclass(frozen=True)
class GeneratedImage:
    png: bytes
    seed: int
    width: int
    height: int
    index: int = 0  # of the request's n images (seed = the request's seed + index)


def encode_png(pixels: npt.NDArray[np.generic]) -> bytes:
    """uint8 RGB pixels [height, width, 3] -> PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(pixels, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


async def png_preview(preview: common_pb2.Preview) -> common_pb2.Preview:
    """The DiT's preview (uint8 pixels) as clients get it: PNG, encoded in a worker thread."""
    png = await asyncio.to_thread(encode_png, array_from_proto(preview.pixels))
    return common_pb2.Preview(step_index=preview.step_index, png=png, width=preview.width,
                              height=preview.height)


def preview_options(ask: PreviewAsk) -> common_pb2.PreviewOptions:
    """What the DiT's start message asks for (size 0: the DiT's default)."""
    return common_pb2.PreviewOptions(every=ask.every, size=ask.size or 0)


class _Progress:
    """Forwards the queued/progress/preempted events of the image stages to `emit`, tagged with
    the image they are about (`part`; None for the prompt, which all images share).

    With previews every `preview_every` steps, the DiT's progress of a step that has one is held
    until its preview follows (the DiT sends them back to back) and sent once, carrying the
    preview as PNG (encoded in a worker thread: the loop never blocks on it)."""

    def __init__(self, emit: Emit[GeneratedImage] | None, part: Part | None = None,
                 preview_every: int = 0) -> None:
        self.emit = emit
        self.part = part
        self.preview_every = preview_every
        self.held: common_pb2.Progress | None = None

    def of(self, part: Part) -> _Progress:
        return _Progress(self.emit, part, self.preview_every)

    async def flush(self, stage: str) -> None:
        """Send a held progress (its preview never came)."""
        if self.held is not None:
            held, self.held = self.held, None
            await self._forward(stage, held)

    async def _preview(self, stage: str, preview: common_pb2.Preview) -> None:
        progress = self.held or common_pb2.Progress(step_index=preview.step_index)
        self.held = None
        progress.preview.CopyFrom(await png_preview(preview))
        await self._forward(stage, progress)

    async def _forward(self, stage: str,
                       event: common_pb2.Queued | common_pb2.Progress | common_pb2.Preempted
                       ) -> None:
        if self.emit is not None:
            await self.emit(StageEvent(stage, event, self.part))

    async def tokenizer(self, stage: str,
                        response: tokenizer_service_pb2.EncodePromptResponse) -> None:
        if response.WhichOneof("event") == "queued":
            await self._forward(stage, response.queued)

    async def dit(self, stage: str, response: dit_service_pb2.DenoiseResponse) -> None:
        event = response.WhichOneof("event")
        if event == "preview":
            await self._preview(stage, response.preview)
            return
        await self.flush(stage)
        match event:
            case "queued":
                await self._forward(stage, response.queued)
            case "progress":
                step = response.progress.step_index
                if self.preview_every and step % self.preview_every == 0:
                    self.held = response.progress
                else:
                    await self._forward(stage, response.progress)
            case "preempted":
                await self._forward(stage, response.preempted)

    async def vae(self, stage: str, response: vae_service_pb2.DecodeLatentsResponse) -> None:
        if response.WhichOneof("event") == "queued":
            await self._forward(stage, response.queued)

    async def vae_encode(self, stage: str, response: vae_service_pb2.EncodeImageResponse) -> None:
        match response.WhichOneof("event"):
            case "queued":
                await self._forward(stage, response.queued)
            case "progress":
                await self._forward(stage, response.progress)


async def _encode_prompt(params: ImageParams, scope: CancelScope, stubs: ImageStubs,
                         progress: _Progress, images: tuple[common_pb2.Tensor, ...] = ()
                         ) -> tokenizer_service_pb2.EncodePromptResult:
    """The prompt's embeddings (an edit's: read together with its input `images`)."""
    start = tokenizer_service_pb2.EncodePromptStart(request_id=scope.stage_request_id,
                                                    prompt=params.prompt, images=images)
    if params.negative_prompt is not None:
        start.negative_prompt = params.negative_prompt
    encoded = await call_stage(
        scope, "tokenizer", stubs.tokenizer.EncodePrompt,
        tokenizer_service_pb2.EncodePromptRequest(start=start),
        tokenizer_service_pb2.EncodePromptRequest, on_event=progress.tokenizer)
    return encoded.result


async def _encode_image(image: common_pb2.Tensor, width: int, height: int, scope: CancelScope,
                        stubs: ImageStubs, progress: _Progress) -> common_pb2.Tensor:
    """An edit's input image -> the normalized latents the DiT is conditioned on (VAE)."""
    encoded = await call_stage(
        scope, "vae", stubs.vae.EncodeImage, vae_service_pb2.EncodeImageRequest(
            start=vae_service_pb2.EncodeImageStart(
                request_id=scope.stage_request_id, image=image, height=height, width=width)),
        vae_service_pb2.EncodeImageRequest, on_event=progress.vae_encode)
    return encoded.result.latents


async def _draw(params: ImageParams, part: Part, encoded: tokenizer_service_pb2.EncodePromptResult,
                scope: CancelScope, stubs: ImageStubs, progress: _Progress,
                condition: tuple[common_pb2.Tensor, ...]) -> GeneratedImage:
    """DiT -> VAE -> PNG for one image, as its own stage requests (its sub-id); `condition`:
    an edit's input image latents."""
    request_id = scope.sub_request_ids[part.index]
    start = dit_service_pb2.DenoiseStart(
        request_id=request_id,
        prompt_embeds=encoded.prompt_embeds,
        prompt_embeds_mask=encoded.prompt_embeds_mask,
        negative_prompt_embeds=encoded.negative_prompt_embeds,
        negative_prompt_embeds_mask=encoded.negative_prompt_embeds_mask,
        height=params.height, width=params.width,
        num_inference_steps=params.num_inference_steps,
        true_cfg_scale=params.true_cfg_scale, seed=part.seed,
        execution_mode=params.execution_mode, priority=params.priority,
        condition_latents=condition, lora=lora_to_proto(params.lora))
    if params.step_cache_threshold is not None:
        start.step_cache_threshold = params.step_cache_threshold
    if params.preview is not None:
        start.preview.CopyFrom(preview_options(params.preview))
    denoised = await call_stage(
        scope, "dit", stubs.dit.Denoise, dit_service_pb2.DenoiseRequest(start=start),
        dit_service_pb2.DenoiseRequest, request_id=request_id, on_event=progress.dit)
    await progress.flush("dit")
    decoded = await call_stage(
        scope, "vae", stubs.vae.DecodeLatents, vae_service_pb2.DecodeLatentsRequest(
            start=vae_service_pb2.DecodeLatentsStart(
                request_id=request_id, latents=denoised.result.latents,
                height=params.height, width=params.width)),
        vae_service_pb2.DecodeLatentsRequest, request_id=request_id, on_event=progress.vae)
    pixels = array_from_proto(decoded.result.pixels)
    png = await asyncio.to_thread(encode_png, pixels[0])  # off the event loop
    return GeneratedImage(png=png, seed=part.seed, width=params.width, height=params.height,
                          index=part.index)


async def draw_images(params: ImageParams, scope: CancelScope, stubs: ImageStubs,
                          emit: Emit[GeneratedImage] | None = None) -> list[GeneratedImage]:
    """Tokenizer once, then DiT -> VAE for every image side by side (seeds seed, seed+1, ...).

    Each image is its own DiT request (`scope.sub_request_ids`), so the DiT batches them, and
    is decoded as soon as its DiT finishes. The first failure cancels the other images. The
    images come back in index order; `emit`, if given, receives a StageEvent for each
    queued/progress/preempted event and an Output for each image as soon as it is decoded.
    The scope must have been opened with `params.n` parts.
    """
    _check_parts(params, scope)
    progress = _Progress(emit, preview_every=params.preview.every if params.preview else 0)
    encoded = await _encode_prompt(params, scope, stubs, progress)
    return await _draw_all(params, encoded, (), scope, stubs, progress)


async def draw_edits(params: EditParams, scope: CancelScope, stubs: ImageStubs,
                      emit: Emit[GeneratedImage] | None = None) -> list[GeneratedImage]:
    """Tokenizer (prompt + input images) and VAE EncodeImage (the first input image, at the
    condition size) side by side, then DiT -> VAE for every image as in draw_images, the
    DiT conditioned on the image latents. A cancel stops whichever stage is open; no stage
    after it runs."""
    _check_parts(params.image, scope)
    preview = params.image.preview
    progress = _Progress(emit, preview_every=preview.every if preview else 0)
    images = tuple(array_to_proto(image) for image in params.inputs)
    async with side_by_side() as group:
        prompt = group.create_task(_encode_prompt(params.image, scope, stubs, progress, images))
        latents = group.create_task(_encode_image(
            images[0], params.condition_width, params.condition_height, scope, stubs, progress))
    return await _draw_all(params.image, prompt.result(), (latents.result(),), scope, stubs,
                           progress)


def _check_parts(params: ImageParams, scope: CancelScope) -> None:
    if len(scope.sub_request_ids) != params.n:
        raise ValueError(f"a request of {params.n} images needs a scope of {params.n} parts")


async def _draw_all(params: ImageParams, encoded: tokenizer_service_pb2.EncodePromptResult,
                    condition: tuple[common_pb2.Tensor, ...], scope: CancelScope,
                    stubs: ImageStubs, progress: _Progress) -> list[GeneratedImage]:
    """DiT -> VAE for each of the n images side by side, each emitted once decoded."""

    async def draw(part: Part) -> GeneratedImage:
        image = await _draw(params, part, encoded, scope, stubs, progress.of(part), condition)
        if progress.emit is not None:
            await progress.emit(Output(image))
        return image

    async with side_by_side() as group:
        drawing = [group.create_task(draw(Part(index, params.seed + index)))
                   for index in range(params.n)]
    return [task.result() for task in drawing]


# -- prepare + run, for every transport -----------------------------------------------------------

ImageEvents = AsyncGenerator[
    StageEvent | Output[GeneratedImage] | Done[list[GeneratedImage]], None]


@dataclass(frozen=True)
class ImageJob:
    """A checked image request and the recipe that runs it."""

    recipe: Recipe
    params: ImageParams


@dataclass(frozen=True)
class EditJob:
    """A checked edit request and the recipe that runs it."""

    recipe: Recipe
    params: EditParams


async def prepare_images(core: GatewayCore, request: ImageRequest) -> ImageJob:
    recipe = core.mesh.recipe(request.model, Task.TEXT_TO_IMAGE)
    facts = await core.catalog.image_facts(recipe)
    return ImageJob(recipe, resolve_image_request(request, recipe.image_defaults, facts))


async def generate_images(core: GatewayCore, job: ImageJob, context: RequestContext,
                          emit: Emit[GeneratedImage] | None = None) -> list[GeneratedImage]:
    async with core.request_scope(job.recipe, context, parts=job.params.n) as scope:
        return await draw_images(job.params, scope, core.mesh.image_stubs(job.recipe),
                                              emit)


def image_events(core: GatewayCore, job: ImageJob, context: RequestContext) -> ImageEvents:
    """generate_images as a stream: stage progress, each image, then Done."""

    async def run(emit: Emit[GeneratedImage]) -> list[GeneratedImage]:
        return await generate_images(core, job, context, emit)

    return stream_pipeline(run)


async def prepare_edit(core: GatewayCore, request: EditRequest) -> EditJob:
    """Pick the image-edit recipe, read its stages' facts and check the request against them
    (a 400 naming the field before any stage runs). The input images are decoded in a worker
    thread."""
    recipe = core.mesh.recipe(request.image.model, Task.IMAGE_EDIT)
    facts = await core.catalog.edit_facts(recipe)
    if facts.task != Task.IMAGE_EDIT.value or not facts.can_encode or facts.max_images < 1:
        raise InvalidRequest("model", f"model {recipe.name!r} does not edit images: its DiT "
                             f"serves {facts.task or 'an unknown task'!r}, its VAE "
                             f"{'encodes' if facts.can_encode else 'cannot encode'} images")
    params = await asyncio.to_thread(resolve_edit_request, request, recipe.image_defaults,
                                     facts)
    return EditJob(recipe, params)


async def run_edit(core: GatewayCore, job: EditJob, context: RequestContext,
                   emit: Emit[GeneratedImage] | None = None) -> list[GeneratedImage]:
    """The edited images (n of them, seeds seed, seed+1, ...) in index order."""
    async with core.request_scope(job.recipe, context, parts=job.params.image.n) as scope:
        return await draw_edits(job.params, scope, core.mesh.image_stubs(job.recipe),
                                          emit)


def edit_events(core: GatewayCore, job: EditJob, context: RequestContext) -> ImageEvents:
    """run_edit as a stream: stage progress, each image, then Done."""

    async def run(emit: Emit[GeneratedImage]) -> list[GeneratedImage]:
        return await run_edit(core, job, context, emit)

    return stream_pipeline(run)
