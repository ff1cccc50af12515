"""VAE stage servicer: DecodeLatents over the LatentDecoderAdapter."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import torch

from stagemesh.services.vae.adapter import DecodedImages, LatentDecoderAdapter, LatentsInput
from stagemesh.shared.engine.adapter import EngineRequest
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.proto.v1 import vae_service_pb2 as pb
from stagemesh.shared.proto.v1 import vae_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.torch_tensors import from_proto, to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VaeService"].full_name


def _request(start: pb.DecodeLatentsStart, deadline: float | None) -> EngineRequest:
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        payload=LatentsInput(latents=from_proto(start.latents), height=start.height,
                             width=start.width))


def _result(decoded: DecodedImages) -> pb.DecodeLatentsResult:
    return pb.DecodeLatentsResult(pixels=to_proto(torch.from_numpy(decoded.pixels)))


WIRE = StageWire(response_cls=pb.DecodeLatentsResponse, make_request=_request,
                 encode_result=_result)


class VaeServicer(vae_service_pb2_grpc.VaeServiceServicer):
    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine

    async def DecodeLatents(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in serve_stage_stream(self.engine, WIRE, request_iterator, context):
            yield response


def build_stage(model_dir: Path, options: dict[str, Any]) -> StageBundle:
    engine = StepEngine(LatentDecoderAdapter(model_dir))
    return StageBundle(
        name="vae", engines=[engine], service_names=[SERVICE_NAME],
        register=lambda server: vae_service_pb2_grpc.add_VaeServiceServicer_to_server(
            VaeServicer(engine), server),
        info={"model": str(model_dir)})
