"""Speech-to-text over the Transcriber stage: decoded audio in, final segments out.

One `Transcribe` stream per request: `start` (the upload's own sample rate: the stage resamples,
VAD on, the request's language and prompt), then the samples as `input` chunks of at most the
stage's `max_chunk_seconds`, the last one `final`. Each final segment is emitted as it is
decoded (a streamed response sends it at once), and the result closes the transcript. The
call runs under the request's CancelScope: a client gone or a cancel by id stops the stage at
its next step. Chat's `input_audio` parts are heard the same way (`hear`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.calls import CancelScope, call_stage
from stagemesh.gateway.mesh.events import Done, Emit, Output, StageEvent, stream_pipeline
from stagemesh.gateway.mesh.stubs import transcriber_stub
from stagemesh.gateway.recipes import Recipe, Task
from stagemesh.gateway.transcriptions.protocol import (
    DecodedAudio,
    Segment,
    Transcript,
    TranscriptionRequest,
    decode_audio,
)
from stagemesh.shared.proto.v1 import transcriber_service_pb2 as pb
from stagemesh.shared.tensors import array_to_proto

TranscribeCall = grpc.aio.StreamStreamCall[pb.TranscribeRequest, pb.TranscribeResponse]


@dataclass(frozen=True)
class TranscriptionJob:
    """Checked audio for a speech-to-text recipe."""

    recipe: Recipe
    audio: DecodedAudio
    language: str
    prompt: str = ""


def _check_audio(facts: pb.DescribeTranscriberResponse, audio: DecodedAudio, field: str) -> None:
    if audio.sample_rate not in facts.sample_rates:
        raise InvalidRequest(field, f"{field} has a sample rate of {audio.sample_rate} Hz; "
                             f"accepted: {list(facts.sample_rates)}")
    if audio.seconds > facts.max_seconds:
        raise InvalidRequest(field, f"{field} is {audio.seconds:.1f} s long; the limit is "
                             f"{facts.max_seconds:g} s")


def _language(facts: pb.DescribeTranscriberResponse, language: str) -> str:
    if not language:
        return facts.languages[0] if facts.languages else ""
    if language not in facts.languages:
        raise InvalidRequest("language", f"language {language!r} is not served by this model; "
                             f"accepted: {list(facts.languages)}")
    return language


async def prepare_audio(core: GatewayCore, recipe: Recipe, audio: DecodedAudio, field: str,
                        language: str = "", prompt: str = "") -> TranscriptionJob:
    """Check decoded audio against what the recipe's transcriber publishes."""
    facts = await core.catalog.read(core.catalog.transcriber, recipe)
    _check_audio(facts, audio, field)
    return TranscriptionJob(recipe, audio, _language(facts, language), prompt)


async def prepare_transcription(core: GatewayCore,
                                request: TranscriptionRequest) -> TranscriptionJob:
    recipe = core.mesh.recipe(request.model, Task.SPEECH_TO_TEXT)
    # Decoding an upload of up to megabytes is CPU work: keep it off the event loop.
    audio = await asyncio.to_thread(decode_audio, request.audio, "file")
    return await prepare_audio(core, recipe, audio, "file", request.language, request.prompt)


class _Listener:
    """Samples -> the stage's input, final segments -> `emit`, for one request."""

    def __init__(self, job: TranscriptionJob, chunk_seconds: float,
                 emit: Emit[Segment] | None) -> None:
        self.job, self.emit = job, emit
        self.chunk = max(1, int(job.audio.sample_rate * chunk_seconds))
        self.segments: list[Segment] = []

    async def pump(self, call: TranscribeCall) -> None:
        samples = self.job.audio.samples
        count = max(1, math.ceil(samples.shape[0] / self.chunk))
        for i in range(count):
            piece = samples[i * self.chunk: (i + 1) * self.chunk]
            await call.write(pb.TranscribeRequest(input=pb.TranscribeInput(
                pcm=array_to_proto(piece), final=i == count - 1)))

    async def on_event(self, stage: str, response: pb.TranscribeResponse) -> None:
        if response.WhichOneof("event") == "segment" and response.segment.final:
            s = response.segment
            segment = Segment(index=s.index, text=s.text.strip(), start_ms=s.start_ms,
                              end_ms=s.end_ms, no_speech_prob=s.no_speech_prob)
            self.segments.append(segment)
            if self.emit is not None:
                await self.emit(Output(segment))


async def listen(job: TranscriptionJob, scope: CancelScope, core: GatewayCore,
                 emit: Emit[Segment] | None = None) -> Transcript:
    """One Transcribe stream over the job's audio; emits each final segment as it comes."""
    facts = await core.catalog.read(core.catalog.transcriber, job.recipe)
    listener = _Listener(job, facts.max_chunk_seconds or 1.0, emit)
    start = pb.TranscribeStart(request_id=scope.stage_request_id,
                               sample_rate=job.audio.sample_rate, language=job.language,
                               prompt=job.prompt, vad=pb.VAD_MODE_ON,
                               partial_interval_ms=-1)  # final segments only
    stub = transcriber_stub(core.mesh.channel(job.recipe.stage("transcriber")))
    done = await call_stage(scope, "transcriber", stub.Transcribe,
                            pb.TranscribeRequest(start=start), pb.TranscribeRequest,
                            on_event=listener.on_event, pump_inputs=listener.pump)
    segments = tuple(sorted(listener.segments, key=lambda s: s.index))
    text = done.result.text.strip() or " ".join(s.text for s in segments if s.text)
    return Transcript(text=text, segments=segments, seconds=job.audio.seconds,
                      language=job.language)


# -- run, for every transport ---------------------------------------------------------------

TranscriptEvents = AsyncGenerator[StageEvent | Output[Segment] | Done[Transcript], None]


async def transcribe(core: GatewayCore, job: TranscriptionJob, context: RequestContext,
                     emit: Emit[Segment] | None = None) -> Transcript:
    async with core.request_scope(job.recipe, context) as scope:
        return await listen(job, scope, core, emit)


def transcript_events(core: GatewayCore, job: TranscriptionJob,
                      context: RequestContext) -> TranscriptEvents:
    """transcribe as a stream: each final segment, then Done with the transcript."""

    async def run(emit: Emit[Segment]) -> Transcript:
        return await transcribe(core, job, context, emit)

    return stream_pipeline(run)
