"""Talker stage for CSM: GenerateFrames over the TalkerAdapter, one engine step per frame
(each frame its own `frames` event, `codes` filled)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias, TypedDict

import torch

from stagemesh.services.talker.csm_adapter import (
    CPU_DTYPE,
    SamplingParams,
    TalkerAdapter,
    TalkerInput,
    TalkerLimits,
    TalkerResult,
    TalkerState,
    VoiceContext,
)
from stagemesh.services.talker.servicer import DEFAULT_MAX_RUNNING, talker_bundle
from stagemesh.shared.devices import DeviceOptions, Placement, resolve_placement
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, NoStream, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import talker_service_pb2 as pb
from stagemesh.shared.stage_runtime import StageBundle, stage_description
from stagemesh.shared.stage_stream import StageRoute, StageWire
from stagemesh.shared.torch_tensors import optional_from_proto, to_proto

log = logging.getLogger(__name__)

TalkerEngine: TypeAlias = StepEngine[
    TalkerInput, NoStream, TalkerState, torch.Tensor, TalkerResult
]
GenerateFramesWire: TypeAlias = StageWire[
    pb.GenerateFramesRequest, pb.GenerateFramesResponse, TalkerInput, NoStream, torch.Tensor,
    TalkerResult,
]


#: Smallest temperature other than 0 (greedy): logits divided by less overflow to inf/NaN (1e-40
#: did, failing the batch it ran in); below it sampling is greedy in all but name anyway.
MIN_TEMPERATURE = 1e-2


def _check_temperature(temperature: float) -> None:
    """Refuse a temperature that cannot give finite logits; the adapter checks the range."""
    if 0 < temperature < MIN_TEMPERATURE:
        raise InvalidInputError(
            "temperature",
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}")


class TalkerLimitOptions(TypedDict, total=False):
    """The stage's limits and default voice: TalkerAdapter's keyword arguments."""

    max_input_chars: int
    max_new_frames: int
    default_voice: str


def _sampling(params: pb.SamplingParams) -> SamplingParams:
    # proto3 zeros mean "off" for top_p/top_k and greedy for temperature (see the proto).
    _check_temperature(params.temperature)
    return SamplingParams(temperature=params.temperature,
                          top_p=params.top_p if 0 < params.top_p < 1 else 1.0,
                          top_k=params.top_k, seed=params.seed)


def _request(
    message: pb.GenerateFramesRequest, deadline: float | None
) -> EngineRequest[TalkerInput]:
    start = message.start
    if start.instructions or start.language:
        # CSM has no instruction or language conditioning; harmless to ignore, so say it.
        log.warning("the talker ignores instructions/language (CSM does not use them)")
    codes = optional_from_proto(start.reference_codes)
    context = (VoiceContext(codes=codes, text=start.reference_text)
               if codes is not None else None)
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        budget=StepBudget(total_steps=None),  # open-ended: an end-of-audio frame may stop it
        payload=TalkerInput(text=start.text, voice=start.voice or None,
                            sampling=_sampling(start.sampling),
                            # 0 (unset) = the stage's default_max_new_frames
                            max_new_frames=start.sampling.max_new_frames or None,
                            context=context))


def _result(result: TalkerResult) -> pb.GenerateFramesResult:
    return pb.GenerateFramesResult(total_frames=int(result.frames.shape[0]),
                                   finish_reason=result.finish_reason.value)


def _wire() -> GenerateFramesWire:
    """One wire per stream: the partial encoder numbers that stream's frames."""
    index = itertools.count()

    def encode_frame(frame: torch.Tensor) -> pb.GenerateFramesResponse:
        return pb.GenerateFramesResponse(frames=pb.CodecFrames(
            codes=to_proto(frame.reshape(1, -1)), first_frame_index=next(index)))

    return StageWire(response_cls=pb.GenerateFramesResponse, make_request=_request,
                     encode_result=_result, encode_partial=encode_frame)


def _describe(
    model_dir: Path, engine: TalkerEngine, limits: TalkerLimits, placement: Placement
) -> pb.DescribeTalkerResponse:
    return pb.DescribeTalkerResponse(
        stage=stage_description("talker", model_dir, engine, placement),
        voices=limits.voices, default_voice=limits.default_voice,
        supports_voice_clone=limits.supports_voice_clone,
        max_input_chars=limits.max_input_chars,
        max_reference_text_chars=limits.max_reference_text_chars,
        max_new_frames=limits.max_new_frames,
        default_max_new_frames=limits.default_max_new_frames, frame_rate=limits.frame_rate,
        max_temperature=limits.max_temperature, max_top_k=limits.max_top_k)


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """options: EngineOptions (max_running, default 8), TalkerLimitOptions, DeviceOptions."""
    engine_options, limit_options, device_options = parse_options(
        "talker", options, EngineOptions, TalkerLimitOptions, DeviceOptions)
    placement = resolve_placement("talker", device_options, CPU_DTYPE)
    adapter = TalkerAdapter(model_dir, **limit_options, placement=placement)
    engine = StepEngine(adapter,
                        max_running=engine_options.get("max_running", DEFAULT_MAX_RUNNING))
    return talker_bundle(
        model_dir, engine, StageRoute.per_stream(engine, _wire),
        _describe(model_dir, engine, adapter.limits, placement),
        {**placement.facts(), "default_voice": adapter.limits.default_voice})
