"""Transcriber stage servicer: Transcribe (audio in; speech events and segments out) and
DescribeTranscriber, over one StepEngine of the Whisper adapter.

A session holds its engine place from its start to the end of its audio, so `max_sessions` is
both the engine's max_running and its max_pending: one session more is refused at once
(RESOURCE_EXHAUSTED) rather than queued behind a conversation of unknown length.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TypeAlias, TypedDict

import grpc
import numpy as np
import torch

from stagemesh.services.transcriber.whisper_adapter import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_PARTIAL_MS,
    DEFAULT_SILENCE_MS,
    DEFAULT_VAD_THRESHOLD,
    MAX_CHUNK_SECONDS,
    SAMPLE_RATES,
    AudioInput,
    Segment,
    SpeechStarted,
    SpeechStopped,
    TranscribeInput,
    TranscribeResult,
    TranscribeState,
    TranscriptEvent,
    WhisperTranscriberAdapter,
)
from stagemesh.shared.devices import CpuDtype, DeviceOptions, cpu_threads, resolve_placement
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.options import parse_options
from stagemesh.shared.proto.v1 import transcriber_service_pb2 as pb
from stagemesh.shared.proto.v1 import transcriber_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle, stage_description
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.tensors import array_from_proto, is_set

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TranscriberService"].full_name
DEFAULT_MAX_SESSIONS = 4
#: The activations' dtype on the CPU (the weights are int8 whatever it is): float32, as
#: CTranslate2's own CPU default; bfloat16 is an option where the CPU computes it natively.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)
#: PCM16 full scale.
_INT16_SCALE = 32768.0

TranscriberEngine: TypeAlias = StepEngine[
    TranscribeInput, AudioInput, TranscribeState, TranscriptEvent, TranscribeResult]
TranscribeWire: TypeAlias = StageWire[
    pb.TranscribeRequest, pb.TranscribeResponse, TranscribeInput, AudioInput, TranscriptEvent,
    TranscribeResult,
]


class SessionOptions(TypedDict, total=False):
    """Capacity: sessions transcribed at once, and the longest audio one may carry."""

    max_sessions: int
    max_seconds: float


class ListeningDefaults(TypedDict, total=False):
    """Defaults for starts that leave these 0."""

    silence_duration_ms: int
    vad_threshold: float
    partial_interval_ms: int


def _request(defaults: ListeningDefaults, message: pb.TranscribeRequest,
             deadline: float | None) -> EngineRequest[TranscribeInput]:
    start = message.start
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        budget=StepBudget(total_steps=None),  # runs until its audio ends and is decoded
        payload=TranscribeInput(
            sample_rate=start.sample_rate, language=start.language, prompt=start.prompt,
            vad=start.vad != pb.VAD_MODE_OFF,
            silence_duration_ms=start.silence_duration_ms or defaults.get(
                "silence_duration_ms", DEFAULT_SILENCE_MS),
            vad_threshold=start.vad_threshold or defaults.get(
                "vad_threshold", DEFAULT_VAD_THRESHOLD),
            partial_interval_ms=start.partial_interval_ms or defaults.get(
                "partial_interval_ms", DEFAULT_PARTIAL_MS),
            early_partials=start.early_partials))


def _input(message: pb.TranscribeRequest) -> AudioInput:
    """PCM16 or float32 samples -> float32 in [-1, 1]; no tensor is an empty (final) input."""
    audio = message.input
    if not is_set(audio.pcm):
        return AudioInput(np.zeros(0, np.float32), final=audio.final)
    pcm = array_from_proto(audio.pcm)
    if pcm.dtype == np.int16:
        samples = pcm.astype(np.float32) / np.float32(_INT16_SCALE)
    elif pcm.dtype == np.float32:
        samples = pcm.astype(np.float32, copy=False)
    else:
        raise InvalidInputError("input.pcm", f"audio must be int16 (PCM16) or float32, got "
                                f"{pcm.dtype}")
    if samples.ndim != 1:
        raise InvalidInputError("input.pcm", f"audio must be mono [samples], got shape "
                                f"{tuple(samples.shape)}")
    if not bool(np.isfinite(samples).all()):
        raise InvalidInputError("input.pcm", "audio contains NaN or infinite values")
    return AudioInput(samples, final=audio.final)


def _event(event: TranscriptEvent) -> pb.TranscribeResponse:
    if isinstance(event, SpeechStarted):
        return pb.TranscribeResponse(speech_started=pb.SpeechStarted(
            audio_start_ms=event.audio_start_ms))
    if isinstance(event, SpeechStopped):
        return pb.TranscribeResponse(speech_stopped=pb.SpeechStopped(
            audio_end_ms=event.audio_end_ms))
    return pb.TranscribeResponse(segment=_segment(event))


def _segment(segment: Segment) -> pb.TranscriptSegment:
    return pb.TranscriptSegment(
        index=segment.index, text=segment.text, start_ms=segment.start_ms,
        end_ms=segment.end_ms, final=segment.final, no_speech_prob=segment.no_speech_prob)


def _result(result: TranscribeResult) -> pb.TranscribeResult:
    return pb.TranscribeResult(text=result.text, audio_ms=result.audio_ms,
                               segments=result.segments, decode_seconds=result.decode_seconds)


class TranscriberServicer(transcriber_service_pb2_grpc.TranscriberServiceServicer):
    def __init__(self, engine: TranscriberEngine, wire: TranscribeWire,
                 description: pb.DescribeTranscriberResponse) -> None:
        self.engine = engine
        self.wire = wire
        self.description = description

    async def Transcribe(
        self,
        request_iterator: AsyncIterator[pb.TranscribeRequest],
        context: grpc.aio.ServicerContext[pb.TranscribeRequest, pb.TranscribeResponse],
    ) -> AsyncIterator[pb.TranscribeResponse]:
        async for response in serve_stage_stream(self.engine, self.wire, request_iterator,
                                                 context):
            yield response

    async def DescribeTranscriber(
        self,
        request: pb.DescribeTranscriberRequest,
        context: grpc.aio.ServicerContext[pb.DescribeTranscriberRequest,
                                          pb.DescribeTranscriberResponse],
    ) -> pb.DescribeTranscriberResponse:
        return self.description


def build_stage(model_dir: Path, options: Mapping[str, object], *,
                threads: int | None = None) -> StageBundle:
    """options: SessionOptions (max_sessions, default 4; max_seconds, default 600),
    ListeningDefaults and DeviceOptions (CTranslate2 runs on the CPU or CUDA); `threads`:
    CTranslate2's intra-op threads on the CPU (default: the stage's share, `cpu_threads`)."""
    sessions, defaults, device_options = parse_options(
        "transcriber", options, SessionOptions, ListeningDefaults, DeviceOptions)
    placement = resolve_placement("transcriber", device_options, CPU_DTYPE)
    threads = cpu_threads(threads)
    max_sessions = sessions.get("max_sessions", DEFAULT_MAX_SESSIONS)
    if max_sessions < 1:
        raise ValueError(f"stage transcriber: option 'max_sessions' must be >= 1, got "
                         f"{max_sessions}")
    adapter = WhisperTranscriberAdapter(
        model_dir, threads=threads, device=placement.device, dtype=placement.dtype_name,
        max_seconds=float(sessions.get("max_seconds", DEFAULT_MAX_SECONDS)))
    probe = _request(defaults, pb.TranscribeRequest(start=pb.TranscribeStart(
        request_id="options", sample_rate=adapter.sample_rate)), None)
    adapter.check_inputs(probe.payload)  # bad defaults fail at start-up, not per request
    engine = StepEngine(adapter, max_running=max_sessions, max_pending=max_sessions)
    rule = probe.payload
    description = pb.DescribeTranscriberResponse(
        stage=stage_description("transcriber", model_dir, engine, placement),
        sample_rates=SAMPLE_RATES, model_sample_rate=adapter.sample_rate,
        languages=adapter.folder.languages, max_seconds=adapter.max_seconds,
        max_sessions=max_sessions, max_chunk_seconds=MAX_CHUNK_SECONDS,
        default_silence_duration_ms=rule.silence_duration_ms,
        default_vad_threshold=rule.vad_threshold,
        default_partial_interval_ms=rule.partial_interval_ms)
    wire: TranscribeWire = StageWire(
        response_cls=pb.TranscribeResponse,
        make_request=lambda message, deadline: _request(defaults, message, deadline),
        encode_result=_result, encode_partial=_event, make_input=_input)
    servicer = TranscriberServicer(engine, wire, description)
    add_servicer = transcriber_service_pb2_grpc.add_TranscriberServiceServicer_to_server
    return StageBundle(
        name="transcriber", engines=[engine], service_names=[SERVICE_NAME],
        register=lambda server: add_servicer(servicer, server),
        info={"model": str(model_dir), "runtime": "ctranslate2+onnxruntime",
              "device": placement.device_name, "compute_type": adapter.compute_type,
              "threads": str(threads), "max_sessions": str(max_sessions),
              "max_seconds": f"{adapter.max_seconds:g}"})
