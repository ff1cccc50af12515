"""Talker stage servicer: GenerateFrames over the TalkerAdapter, one engine step per frame.

Each generated frame leaves as its own `frames` event while the talker keeps going, so the
codec can start decoding long before generation ends. Concurrent requests share every step
(continuous batching at frame granularity, up to `max_running`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import torch

from stagemesh.services.talker.adapter import (
    DEFAULT_MAX_NEW_FRAMES,
    SamplingParams,
    TalkerAdapter,
    TalkerInput,
    TalkerResult,
    VoiceContext,
)
from stagemesh.shared.engine.adapter import EngineRequest, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.proto.v1 import talker_service_pb2 as pb
from stagemesh.shared.proto.v1 import talker_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.torch_tensors import optional_from_proto, to_proto

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TalkerService"].full_name
DEFAULT_MAX_RUNNING = 8


def _sampling(params: pb.SamplingParams) -> SamplingParams:
    # proto3 zeros mean "off" for top_p/top_k and greedy for temperature (see the proto).
    return SamplingParams(temperature=params.temperature,
                          top_p=params.top_p if 0 < params.top_p < 1 else 1.0,
                          top_k=params.top_k, seed=params.seed)


def _request(start: pb.GenerateFramesStart, deadline: float | None) -> EngineRequest:
    if start.instructions or start.language:
        # CSM has no instruction or language conditioning; harmless to ignore, so say it.
        log.warning("the talker ignores instructions/language (CSM does not use them)")
    codes = optional_from_proto(start.reference_codes)
    context = (VoiceContext(codes=codes, text=start.reference_text)
               if codes is not None else None)
    max_frames = start.sampling.max_new_frames or DEFAULT_MAX_NEW_FRAMES
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        budget=StepBudget(total_steps=None),  # open-ended: an end-of-audio frame may stop it
        payload=TalkerInput(text=start.text, voice=start.voice or None,
                            sampling=_sampling(start.sampling), max_new_frames=max_frames,
                            context=context))


def _result(result: TalkerResult) -> pb.GenerateFramesResult:
    return pb.GenerateFramesResult(total_frames=int(result.frames.shape[0]),
                                   finish_reason=result.finish_reason.value)


def _wire() -> StageWire:
    """One wire per stream: the partial encoder numbers that stream's frames."""
    index = itertools.count()

    def encode_frame(frame: torch.Tensor) -> tuple[str, pb.CodecFrames]:
        return "frames", pb.CodecFrames(codes=to_proto(frame.reshape(1, -1)),
                                        first_frame_index=next(index))

    return StageWire(response_cls=pb.GenerateFramesResponse, make_request=_request,
                     encode_result=_result, encode_partial=encode_frame)


class TalkerServicer(talker_service_pb2_grpc.TalkerServiceServicer):
    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine

    async def GenerateFrames(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in serve_stage_stream(self.engine, _wire(), request_iterator,
                                                 context):
            yield response


def build_stage(model_dir: Path, options: dict[str, Any]) -> StageBundle:
    """options: max_running (default 8) — requests that share each frame step."""
    max_running = int(options.get("max_running", DEFAULT_MAX_RUNNING))
    engine = StepEngine(TalkerAdapter(model_dir), max_running=max_running)
    return StageBundle(
        name="talker", engines=[engine], service_names=[SERVICE_NAME],
        register=lambda server: talker_service_pb2_grpc.add_TalkerServiceServicer_to_server(
            TalkerServicer(engine), server),
        info={"model": str(model_dir), "max_running": str(max_running)})

