"""Text-to-speech: (Codec.encode of the reference clip) -> Talker -> Codec, streaming.

Frames flow while the talker is still generating: every `frames` event of the talker stream
(codes, or latent frames for a latent codec such as a Piper voice's decoder) is written at once
as an `input` message on the codec stream, and every audio chunk the codec
emits goes out through `emit`. A failure of either call stops the other; a cancelled request
(client gone, cancel by id, deadline) stops both at their next step.

Prepare (recipe, the talker's facts, every field checked, a reference clip decoded) and run
(inside the request's CancelScope) are at the end, for every transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
import numpy as np

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.mesh.calls import CancelScope, call_stage, side_by_side
from stagemesh.gateway.mesh.events import Done, Emit, Output, StageEvent, stream_pipeline
from stagemesh.gateway.mesh.stubs import SpeechStubs
from stagemesh.gateway.recipes import Recipe, Task
from stagemesh.gateway.speech.audio import ReferenceAudio, Samples, encode_audio
from stagemesh.gateway.speech.protocol import SpeechParams, SpeechRequest, resolve_speech_request
from stagemesh.shared.proto.v1 import codec_service_pb2, common_pb2, talker_service_pb2
from stagemesh.shared.tensors import array_from_proto, array_to_proto

DecodeCall = grpc.aio.StreamStreamCall[codec_service_pb2.DecodeAudioRequest,
                                       codec_service_pb2.DecodeAudioResponse]


@dataclass(frozen=True)
class AudioPiece:
    """One decoded chunk, in order: mono float32 samples."""

    pcm: Samples
    sample_rate: int


@dataclass(frozen=True)
class SpeechSummary:
    frames: int
    samples: int
    sample_rate: int
    finish_reason: str


async def _encode_reference(scope: CancelScope, stubs: SpeechStubs,
                            reference: ReferenceAudio) -> common_pb2.Tensor:
    encoded = await call_stage(
        scope, "codec", stubs.codec.EncodeAudio, codec_service_pb2.EncodeAudioRequest(
            start=codec_service_pb2.EncodeAudioStart(
                request_id=scope.stage_request_id, pcm=array_to_proto(reference.samples),
                sample_rate=reference.sample_rate)),
        codec_service_pb2.EncodeAudioRequest)
    return encoded.result.codes


def _talker_start(scope: CancelScope, params: SpeechParams,
                  reference_codes: common_pb2.Tensor | None
                  ) -> talker_service_pb2.GenerateFramesRequest:
    start = talker_service_pb2.GenerateFramesStart(
        request_id=scope.stage_request_id, text=params.input, voice=params.voice,
        sampling=talker_service_pb2.SamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seed=params.seed, max_new_frames=params.max_new_frames),
        instructions=params.instructions, language=params.language)
    if reference_codes is not None:
        start.reference_codes.CopyFrom(reference_codes)
        start.reference_text = params.ref_text
    return talker_service_pb2.GenerateFramesRequest(start=start)


class _FrameRelay:
    """Talker frames -> codec input, codec chunks -> `emit`, for one request."""

    def __init__(self, scope: CancelScope, emit: Emit[AudioPiece]) -> None:
        self.scope = scope
        self.emit = emit
        #: Frames on their way to the codec; None marks the talker's successful end.
        self.frames: asyncio.Queue[talker_service_pb2.CodecFrames | None] = asyncio.Queue()

    async def on_talker_event(self, stage: str,
                              response: talker_service_pb2.GenerateFramesResponse) -> None:
        if response.WhichOneof("event") == "frames":
            self.frames.put_nowait(response.frames)

    async def pump_frames(self, call: DecodeCall) -> None:
        # Codes (CSM) or latents (Piper), as the talker made them: the codec of the same recipe
        # decodes the same kind (both publish latent_channels).
        while (frames := await self.frames.get()) is not None:
            await call.write(codec_service_pb2.DecodeAudioRequest(
                input=codec_service_pb2.DecodeAudioInput(codes=frames.codes,
                                                         latents=frames.latents)))
        await call.write(codec_service_pb2.DecodeAudioRequest(
            input=codec_service_pb2.DecodeAudioInput(final=True)))

    async def on_codec_event(self, stage: str,
                             response: codec_service_pb2.DecodeAudioResponse) -> None:
        if response.WhichOneof("event") == "chunk":
            self.scope.check()  # cancelled by id between the two calls' registrations
            chunk = response.chunk
            pcm = array_from_proto(chunk.pcm).astype(np.float32, copy=False)
            await self.emit(Output(AudioPiece(pcm, chunk.sample_rate)))


async def speak(params: SpeechParams, scope: CancelScope, stubs: SpeechStubs,
                     emit: Emit[AudioPiece]) -> SpeechSummary:
    """(Codec.encode) -> Talker -> Codec; emits an Output(AudioPiece) per decoded chunk."""
    reference_codes = None
    if params.reference is not None:
        reference_codes = await _encode_reference(scope, stubs, params.reference)
    relay = _FrameRelay(scope, emit)

    async def run_talker() -> talker_service_pb2.GenerateFramesResult:
        talked = await call_stage(scope, "talker", stubs.talker.GenerateFrames,
                                  _talker_start(scope, params, reference_codes),
                                  talker_service_pb2.GenerateFramesRequest,
                                  on_event=relay.on_talker_event)
        relay.frames.put_nowait(None)
        return talked.result

    async def run_codec() -> codec_service_pb2.DecodeAudioResult:
        decoded = await call_stage(
            scope, "codec", stubs.codec.DecodeAudio, codec_service_pb2.DecodeAudioRequest(
                start=codec_service_pb2.DecodeAudioStart(request_id=scope.stage_request_id)),
            codec_service_pb2.DecodeAudioRequest, on_event=relay.on_codec_event,
            pump_inputs=relay.pump_frames)
        return decoded.result

    async with side_by_side() as group:  # the first failure cancels the other call
        talker_task = group.create_task(run_talker())
        codec_task = group.create_task(run_codec())
    talked, decoded = talker_task.result(), codec_task.result()
    return SpeechSummary(frames=talked.total_frames, samples=decoded.total_samples,
                         sample_rate=decoded.sample_rate, finish_reason=talked.finish_reason)


async def speak_all(params: SpeechParams, scope: CancelScope,
                         stubs: SpeechStubs) -> tuple[bytes, SpeechSummary]:
    """The whole utterance, encoded in the requested format (one-shot responses)."""
    pieces: list[AudioPiece] = []

    async def keep(item: StageEvent | Output[AudioPiece]) -> None:
        if isinstance(item, Output):
            pieces.append(item.value)

    summary = await speak(params, scope, stubs, keep)
    pcm = np.concatenate([p.pcm for p in pieces]) if pieces else np.zeros(0, np.float32)
    encoded = await asyncio.to_thread(encode_audio, pcm, summary.sample_rate,
                                      params.response_format)
    return encoded, summary


# -- prepare + run, for every transport -----------------------------------------------------------

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
        return await speak(job.params, scope, core.mesh.speech_stubs(job.recipe),
                                         emit)


def speech_events(core: GatewayCore, job: SpeechJob, context: RequestContext) -> SpeechEvents:
    """synthesize as a stream: each audio chunk, then Done with the summary."""

    async def run(emit: Emit[AudioPiece]) -> SpeechSummary:
        return await synthesize(core, job, context, emit)

    return stream_pipeline(run)


async def synthesize_all(core: GatewayCore, job: SpeechJob, context: RequestContext) -> bytes:
    async with core.request_scope(job.recipe, context) as scope:
        audio, _ = await speak_all(job.params, scope,
                                                 core.mesh.speech_stubs(job.recipe))
        return audio


async def voices(core: GatewayCore, model: str | None) -> tuple[Recipe, list[str]]:
    """The voices of a speech recipe, as its talker publishes them."""
    recipe = core.mesh.recipe(model, Task.TEXT_TO_SPEECH)
    talker = await core.catalog.read(core.catalog.talker, recipe)
    return recipe, list(talker.voices)
