"""Talker stage servicer, one for every model family: GenerateFrames over the family's engine
and wire (`csm_servicer`, `piper_servicer`), DescribeTalker with the family's facts.

Each step's frames leave as their own `frames` event while the talker keeps going, so the codec
can start decoding long before generation ends. Concurrent requests share every step
(continuous batching at frame granularity, up to `max_running`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from stagemesh.shared.proto.v1 import talker_service_pb2 as pb
from stagemesh.shared.proto.v1 import talker_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle, StageEngine, servicer_bundle
from stagemesh.shared.stage_stream import StreamHandler

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TalkerService"].full_name
#: Requests that share each frame step unless the recipe sets `max_running`.
DEFAULT_MAX_RUNNING = 8

GenerateFramesHandler = StreamHandler[pb.GenerateFramesRequest, pb.GenerateFramesResponse]


class TalkerServicer(talker_service_pb2_grpc.TalkerServiceServicer):
    def __init__(self, generate: GenerateFramesHandler,
                 description: pb.DescribeTalkerResponse) -> None:
        self.generate = generate
        self.description = description

    async def GenerateFrames(
        self,
        request_iterator: AsyncIterator[pb.GenerateFramesRequest],
        context: grpc.aio.ServicerContext[pb.GenerateFramesRequest, pb.GenerateFramesResponse],
    ) -> AsyncIterator[pb.GenerateFramesResponse]:
        async for response in self.generate(request_iterator, context):
            yield response

    async def DescribeTalker(
        self,
        request: pb.DescribeTalkerRequest,
        context: grpc.aio.ServicerContext[pb.DescribeTalkerRequest, pb.DescribeTalkerResponse],
    ) -> pb.DescribeTalkerResponse:
        return self.description


def talker_bundle(model_dir: Path, engine: StageEngine, generate: GenerateFramesHandler,
                  description: pb.DescribeTalkerResponse, info: dict[str, str]) -> StageBundle:
    """The Talker stage of any family: its one engine, the servicer, and facts for the logs
    (`info`, after the model and the engine's capacity)."""
    servicer = TalkerServicer(generate, description)
    return servicer_bundle("talker", model_dir, [engine], servicer,
                        talker_service_pb2_grpc.add_TalkerServiceServicer_to_server,
                        SERVICE_NAME, info)
