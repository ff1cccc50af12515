"""Thinker stage servicer: GenerateTokens over the ThinkerAdapter, one engine step per token.

Each step's text leaves as its own `delta` event while the thinker keeps going, so the gateway
can stream the answer and start speaking its first sentence long before the answer ends.
Concurrent requests share every step (continuous batching at token granularity, up to
`max_running`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TypeAlias, TypedDict

import grpc

from stagemesh.services.thinker.causal_lm_adapter import (
    CPU_DTYPE,
    ChatMessage,
    ThinkerAdapter,
    ThinkerInput,
    ThinkerLimits,
    ThinkerResult,
    ThinkerState,
    TokenDelta,
    TokenSampling,
)
from stagemesh.shared.devices import DeviceOptions, Placement, resolve_placement
from stagemesh.shared.engine.adapter import EngineRequest, NoStream, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import thinker_service_pb2 as pb
from stagemesh.shared.proto.v1 import thinker_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle, servicer_bundle, stage_description
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ThinkerService"].full_name
#: Requests that share each token step unless the recipe sets `max_running`.
DEFAULT_MAX_RUNNING = 8

ThinkerEngine: TypeAlias = StepEngine[
    ThinkerInput, NoStream, ThinkerState, TokenDelta, ThinkerResult
]
GenerateTokensWire: TypeAlias = StageWire[
    pb.GenerateTokensRequest, pb.GenerateTokensResponse, ThinkerInput, NoStream, TokenDelta,
    ThinkerResult,
]


class ThinkerLimitOptions(TypedDict, total=False):
    """The stage's limits and its prefix cache's size: ThinkerAdapter's keyword arguments."""

    max_prompt_tokens: int
    max_tokens: int
    default_max_tokens: int
    max_input_chars: int
    prefix_cache_tokens: int


def _request(
    message: pb.GenerateTokensRequest, deadline: float | None
) -> EngineRequest[ThinkerInput]:
    start = message.start
    sampling = start.sampling
    return EngineRequest(
        request_id=start.request_id, deadline=deadline, priority=start.priority,
        budget=StepBudget(total_steps=None),  # open-ended: the end-of-turn token may stop it
        payload=ThinkerInput(
            messages=tuple(ChatMessage(m.role, m.content) for m in start.messages),
            # proto3 zeros: greedy, top_p off, the stage's default max_tokens
            sampling=TokenSampling(
                temperature=sampling.temperature,
                top_p=sampling.top_p if 0 < sampling.top_p < 1 else 1.0,
                seed=sampling.seed if sampling.HasField("seed") else None),
            max_tokens=sampling.max_tokens or None))


def _result(result: ThinkerResult) -> pb.GenerateTokensResult:
    return pb.GenerateTokensResult(finish_reason=result.finish_reason.value,
                                   prompt_tokens=result.prompt_tokens,
                                   completion_tokens=len(result.token_ids))


def _delta(delta: TokenDelta) -> pb.GenerateTokensResponse:
    return pb.GenerateTokensResponse(delta=pb.TokenDelta(
        text=delta.text, token_ids=delta.token_ids, first_token_index=delta.first_token_index))


WIRE: GenerateTokensWire = StageWire(response_cls=pb.GenerateTokensResponse,
                                     make_request=_request, encode_result=_result,
                                     encode_partial=_delta)


class ThinkerServicer(thinker_service_pb2_grpc.ThinkerServiceServicer):
    def __init__(self, engine: ThinkerEngine, description: pb.DescribeThinkerResponse) -> None:
        self.engine = engine
        self.description = description

    async def GenerateTokens(
        self,
        request_iterator: AsyncIterator[pb.GenerateTokensRequest],
        context: grpc.aio.ServicerContext[pb.GenerateTokensRequest, pb.GenerateTokensResponse],
    ) -> AsyncIterator[pb.GenerateTokensResponse]:
        async for response in serve_stage_stream(self.engine, WIRE, request_iterator, context):
            yield response

    async def DescribeThinker(
        self,
        request: pb.DescribeThinkerRequest,
        context: grpc.aio.ServicerContext[pb.DescribeThinkerRequest,
                                          pb.DescribeThinkerResponse],
    ) -> pb.DescribeThinkerResponse:
        return self.description


def _describe(
    model_dir: Path, engine: ThinkerEngine, limits: ThinkerLimits, placement: Placement
) -> pb.DescribeThinkerResponse:
    return pb.DescribeThinkerResponse(
        stage=stage_description("thinker", model_dir, engine, placement),
        max_prompt_tokens=limits.max_prompt_tokens, max_tokens=limits.max_tokens,
        default_max_tokens=limits.default_max_tokens, max_input_chars=limits.max_input_chars,
        max_messages=limits.max_messages, max_temperature=limits.max_temperature)


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """options: EngineOptions (max_running, default 8), ThinkerLimitOptions, DeviceOptions."""
    engine_options, limit_options, device_options = parse_options(
        "thinker", options, EngineOptions, ThinkerLimitOptions, DeviceOptions)
    placement = resolve_placement("thinker", device_options, CPU_DTYPE)
    adapter = ThinkerAdapter(model_dir, **limit_options, placement=placement)
    engine = StepEngine(adapter,
                        max_running=engine_options.get("max_running", DEFAULT_MAX_RUNNING))
    servicer = ThinkerServicer(engine, _describe(model_dir, engine, adapter.limits, placement))
    return servicer_bundle("thinker", model_dir, [engine], servicer,
                        thinker_service_pb2_grpc.add_ThinkerServiceServicer_to_server,
                        SERVICE_NAME, placement.facts())
