"""Talker stage for a Piper voice: GenerateFrames streams latent z frames.

The contract is the Talker's (`talker_service.proto`): each step's chunk leaves as a `frames`
event whose `latents` carry float32 [frames, 192] (where CSM fills `codes`), and Describe says
`latent_channels` = 192 and `supports_voice_clone` = false, so the gateway refuses a clone with
a 400 before any stage runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias, TypedDict

from stagemesh.services.talker.piper_adapter import (
    Floats,
    PiperTalkerAdapter,
    PiperTalkerInput,
    PiperTalkerResult,
    PiperTalkerState,
)
from stagemesh.services.talker.servicer import DEFAULT_MAX_RUNNING, talker_bundle
from stagemesh.shared.devices import CPU_FLOAT32, cpu_threads
from stagemesh.shared.engine.adapter import EngineRequest, NoStream, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import talker_service_pb2 as pb
from stagemesh.shared.stage_runtime import StageBundle, stage_description
from stagemesh.shared.stage_stream import StageRoute, StageWire
from stagemesh.shared.tensors import array_to_proto, is_set

log = logging.getLogger(__name__)

PiperTalkerEngine: TypeAlias = StepEngine[
    PiperTalkerInput, NoStream, PiperTalkerState, Floats, PiperTalkerResult
]
PiperFramesWire: TypeAlias = StageWire[
    pb.GenerateFramesRequest, pb.GenerateFramesResponse, PiperTalkerInput, NoStream, Floats,
    PiperTalkerResult,
]


class PiperTalkerOptions(TypedDict, total=False):
    """The stage's limits, chunk size and default voice: PiperTalkerAdapter's keywords."""

    max_input_chars: int
    max_new_frames: int
    chunk_frames: int
    default_voice: str


def _request(
    message: pb.GenerateFramesRequest, deadline: float | None
) -> EngineRequest[PiperTalkerInput]:
    start = message.start
    if start.instructions or start.language:
        log.warning("the Piper talker ignores instructions/language (the voice has neither)")
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        budget=StepBudget(total_steps=None),  # one step per chunk; sentences decide how many
        payload=PiperTalkerInput(
            text=start.text, voice=start.voice or None, seed=start.sampling.seed,
            max_new_frames=start.sampling.max_new_frames or None,
            has_reference=is_set(start.reference_codes)))


def _wire() -> PiperFramesWire:
    """One wire per stream: the partial encoder numbers that stream's frames."""
    sent = [0]  # frames sent on this stream so far

    def encode_chunk(chunk: Floats) -> pb.GenerateFramesResponse:
        index, sent[0] = sent[0], sent[0] + chunk.shape[0]
        return pb.GenerateFramesResponse(frames=pb.CodecFrames(
            latents=array_to_proto(chunk), first_frame_index=index))

    def encode_result(result: PiperTalkerResult) -> pb.GenerateFramesResult:
        return pb.GenerateFramesResult(total_frames=result.total_frames,
                                       finish_reason=result.finish_reason)

    return StageWire(response_cls=pb.GenerateFramesResponse, make_request=_request,
                     encode_result=encode_result, encode_partial=encode_chunk)


def _describe(model_dir: Path, engine: PiperTalkerEngine,
              adapter: PiperTalkerAdapter) -> pb.DescribeTalkerResponse:
    limits = adapter.limits
    return pb.DescribeTalkerResponse(
        stage=stage_description("talker", model_dir, engine, CPU_FLOAT32),
        voices=limits.voices, default_voice=limits.default_voice, supports_voice_clone=False,
        max_input_chars=limits.max_input_chars,
        # No clone: a reference transcript is refused with the clone itself (task_type).
        max_reference_text_chars=limits.max_input_chars,
        max_new_frames=limits.max_new_frames,
        default_max_new_frames=limits.default_max_new_frames, frame_rate=limits.frame_rate,
        # The sampling fields have no meaning for this model (see piper_adapter); publishing
        # the gateway's usual ranges keeps requests that set them valid.
        max_temperature=10.0, max_top_k=10_000, latent_channels=limits.latent_channels)


def build_stage(model_dir: Path, options: Mapping[str, object], *,
                threads: int | None = None) -> StageBundle:
    """options: EngineOptions (max_running, default 8) and PiperTalkerOptions; `threads`:
    ONNX Runtime intra-op threads (default: the stage process's share of cores, `cpu_threads`)."""
    engine_options, adapter_options = parse_options(
        "talker", options, EngineOptions, PiperTalkerOptions)
    threads = cpu_threads(threads)
    adapter = PiperTalkerAdapter(model_dir, **adapter_options, threads=threads)
    engine = StepEngine(adapter,
                        max_running=engine_options.get("max_running", DEFAULT_MAX_RUNNING))
    return talker_bundle(
        model_dir, engine, StageRoute.per_stream(engine, _wire),
        _describe(model_dir, engine, adapter),
        {"runtime": "onnxruntime", "threads": str(threads),
         "default_voice": adapter.limits.default_voice})
