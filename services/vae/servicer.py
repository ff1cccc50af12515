"""VAE stage servicer: DecodeLatents over the LatentDecoderAdapter, and its limits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TypeAlias

import grpc
import torch

from stagemesh.services.vae.adapter import (
    CPU_DTYPE,
    DEFAULT_MAX_RUNNING,
    DecodedImages,
    DecodeState,
    LatentDecoderAdapter,
    LatentsInput,
)
from stagemesh.shared.devices import DeviceOptions, resolve_placement
from stagemesh.shared.engine.adapter import EngineRequest, NoStream
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.scheduler import BURST_ADMISSION_WINDOW_SECONDS
from stagemesh.shared.options import parse_options
from stagemesh.shared.proto.v1 import vae_service_pb2 as pb
from stagemesh.shared.proto.v1 import vae_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle, stage_description
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.torch_tensors import from_proto, to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VaeService"].full_name

VaeEngine: TypeAlias = StepEngine[LatentsInput, NoStream, DecodeState, NoStream, DecodedImages]


def _request(
    message: pb.DecodeLatentsRequest, deadline: float | None
) -> EngineRequest[LatentsInput]:
    start = message.start
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        payload=LatentsInput(latents=from_proto(start.latents), height=start.height,
                             width=start.width))


def _result(decoded: DecodedImages) -> pb.DecodeLatentsResult:
    return pb.DecodeLatentsResult(pixels=to_proto(torch.from_numpy(decoded.pixels)))


WIRE: StageWire[pb.DecodeLatentsRequest, pb.DecodeLatentsResponse, LatentsInput, NoStream,
                NoStream, DecodedImages] = StageWire(
    response_cls=pb.DecodeLatentsResponse, make_request=_request, encode_result=_result)


class VaeServicer(vae_service_pb2_grpc.VaeServiceServicer):
    def __init__(self, engine: VaeEngine, description: pb.DescribeVaeResponse) -> None:
        self.engine = engine
        self.description = description

    async def DecodeLatents(
        self,
        request_iterator: AsyncIterator[pb.DecodeLatentsRequest],
        context: grpc.aio.ServicerContext[pb.DecodeLatentsRequest, pb.DecodeLatentsResponse],
    ) -> AsyncIterator[pb.DecodeLatentsResponse]:
        async for response in serve_stage_stream(self.engine, WIRE, request_iterator, context):
            yield response

    async def DescribeVae(
        self,
        request: pb.DescribeVaeRequest,
        context: grpc.aio.ServicerContext[pb.DescribeVaeRequest, pb.DescribeVaeResponse],
    ) -> pb.DescribeVaeResponse:
        return self.description


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """options: DeviceOptions only (any other key is refused)."""
    placement = resolve_placement("vae", parse_options("vae", options, DeviceOptions), CPU_DTYPE)
    adapter = LatentDecoderAdapter(model_dir, placement=placement)
    engine = StepEngine(adapter, max_running=DEFAULT_MAX_RUNNING,
                        admission_window=BURST_ADMISSION_WINDOW_SECONDS)
    limits = adapter.limits
    description = pb.DescribeVaeResponse(
        stage=stage_description("vae", model_dir, engine, placement),
        size_multiple=limits.size_multiple, max_side=limits.max_side)
    servicer = VaeServicer(engine, description)
    return StageBundle(
        name="vae", engines=[engine], service_names=[SERVICE_NAME],
        register=lambda server: vae_service_pb2_grpc.add_VaeServiceServicer_to_server(
            servicer, server),
        info={"model": str(model_dir), **placement.facts()})
