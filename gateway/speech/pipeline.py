"""Text-to-speech: (Codec.encode of the reference clip) -> Talker -> Codec, streaming.

Frames flow while the talker is still generating: every `frames` event of the talker stream
(codes, or latent frames for a latent codec such as a Piper voice's decoder) is written at once
as an `input` message on the codec stream, and every audio chunk the codec
emits goes out through `emit`. A failure of either call stops the other; a cancelled request
(client gone, cancel by id, deadline) stops both at their next step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import numpy as np

from stagemesh.gateway.mesh.cancel import CancelScope, side_by_side
from stagemesh.gateway.mesh.events import Emit, Output, StageEvent
from stagemesh.gateway.mesh.stage_client import call_stage
from stagemesh.gateway.mesh.stubs import SpeechStubs
from stagemesh.gateway.speech.audio import ReferenceAudio, Samples, encode_audio
from stagemesh.gateway.speech.protocol import SpeechParams
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


async def synthesize(params: SpeechParams, scope: CancelScope, stubs: SpeechStubs,
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


async def synthesize_all(params: SpeechParams, scope: CancelScope,
                         stubs: SpeechStubs) -> tuple[bytes, SpeechSummary]:
    """The whole utterance, encoded in the requested format (one-shot responses)."""
    pieces: list[AudioPiece] = []

    async def keep(item: StageEvent | Output[AudioPiece]) -> None:
        if isinstance(item, Output):
            pieces.append(item.value)

    summary = await synthesize(params, scope, stubs, keep)
    pcm = np.concatenate([p.pcm for p in pieces]) if pieces else np.zeros(0, np.float32)
    encoded = await asyncio.to_thread(encode_audio, pcm, summary.sample_rate,
                                      params.response_format)
    return encoded, summary
