"""Speech on the gateway core, for every transport: prepare (recipe, the talker's facts, every
field checked, a reference clip decoded) and run inside the request's CancelScope.

The stage composition itself is pipeline.py (synthesize, synthesize_all).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.mesh.events import Done, Emit, Output, StageEvent, stream_pipeline
from stagemesh.gateway.recipes import Recipe, Task
from stagemesh.gateway.speech import pipeline
from stagemesh.gateway.speech.pipeline import AudioPiece, SpeechSummary
from stagemesh.gateway.speech.protocol import SpeechParams, SpeechRequest, resolve_speech_request

SpeechEvents = AsyncGenerator[StageEvent | Output[AudioPiece] | Done[SpeechSummary], None]


@dataclass(frozen=True)
class SpeechJob:
    """A checked speech request and the recipe that runs it."""

    recipe: Recipe
    params: SpeechParams


async def prepare_speech(core: GatewayCore, request: SpeechRequest) -> SpeechJob:
    recipe = core.mesh.recipe(request.model, Task.TEXT_TO_SPEECH)
    facts = await core.catalog.speech_facts(recipe)
    # Decoding a reference clip is CPU work: keep it off the event loop.
    params = await asyncio.to_thread(resolve_speech_request, request, facts)
    return SpeechJob(recipe, params)


async def synthesize(core: GatewayCore, job: SpeechJob, context: RequestContext,
                     emit: Emit[AudioPiece]) -> SpeechSummary:
    async with core.request_scope(job.recipe, context) as scope:
        return await pipeline.synthesize(job.params, scope, core.mesh.speech_stubs(job.recipe),
                                         emit)


def speech_events(core: GatewayCore, job: SpeechJob, context: RequestContext) -> SpeechEvents:
    """synthesize as a stream: each audio chunk, then Done with the summary."""

    async def run(emit: Emit[AudioPiece]) -> SpeechSummary:
        return await synthesize(core, job, context, emit)

    return stream_pipeline(run)


async def synthesize_all(core: GatewayCore, job: SpeechJob, context: RequestContext) -> bytes:
    async with core.request_scope(job.recipe, context) as scope:
        audio, _ = await pipeline.synthesize_all(job.params, scope,
                                                 core.mesh.speech_stubs(job.recipe))
        return audio


async def voices(core: GatewayCore, model: str | None) -> tuple[Recipe, list[str]]:
    """The voices of a speech recipe, as its talker publishes them."""
    recipe = core.mesh.recipe(model, Task.TEXT_TO_SPEECH)
    talker = await core.catalog.read(core.catalog.talker, recipe)
    return recipe, list(talker.voices)
