"""Images on the gateway core, for every transport: prepare (recipe, stage facts, every field
checked, input images decoded) and run inside the request's CancelScope.

The stage composition itself is pipeline.py (generate_images, edit_images).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images import pipeline
from stagemesh.gateway.images.edit_protocol import EditParams, EditRequest, resolve_edit_request
from stagemesh.gateway.images.pipeline import GeneratedImage
from stagemesh.gateway.images.protocol import ImageParams, ImageRequest, resolve_image_request
from stagemesh.gateway.mesh.events import Done, Emit, Output, StageEvent, stream_pipeline
from stagemesh.gateway.recipes import Recipe, Task

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
        return await pipeline.generate_images(job.params, scope, core.mesh.image_stubs(job.recipe),
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
        return await pipeline.edit_images(job.params, scope, core.mesh.image_stubs(job.recipe),
                                          emit)


def edit_events(core: GatewayCore, job: EditJob, context: RequestContext) -> ImageEvents:
    """run_edit as a stream: stage progress, each image, then Done."""

    async def run(emit: Emit[GeneratedImage]) -> list[GeneratedImage]:
        return await run_edit(core, job, context, emit)

    return stream_pipeline(run)
