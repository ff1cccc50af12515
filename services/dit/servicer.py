"""DiT stage servicer: Denoise over the DenoiseAdapter, one engine step per denoise step."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from stagemesh.services.dit.adapter import DenoiseAdapter, DenoisedLatents, DenoiseInput
from stagemesh.services.tokenizer.adapter import PromptEmbeddings
from stagemesh.shared.engine.adapter import EngineRequest, ExecutionMode, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.scheduler import resolve_total_steps
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2_grpc
from stagemesh.shared.proto.v1 import dit_service_pb2 as pb
from stagemesh.shared.stage_runtime import StageBundle
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.torch_tensors import from_proto, optional_from_proto, to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DitService"].full_name

MODES = {common_pb2.EXECUTION_MODE_STEP: ExecutionMode.STEP,
         common_pb2.EXECUTION_MODE_REQUEST: ExecutionMode.REQUEST}


def _request(start: pb.DenoiseStart, deadline: float | None) -> EngineRequest:
    sigmas = list(start.sigmas) or None
    embeddings = PromptEmbeddings(
        prompt_embeds=from_proto(start.prompt_embeds),
        prompt_embeds_mask=optional_from_proto(start.prompt_embeds_mask),
        negative_prompt_embeds=optional_from_proto(start.negative_prompt_embeds),
        negative_prompt_embeds_mask=optional_from_proto(start.negative_prompt_embeds_mask))
    total = resolve_total_steps(None, sigmas, start.num_inference_steps)
    return EngineRequest(
        request_id=start.request_id, deadline=deadline, mode=MODES.get(start.execution_mode),
        budget=StepBudget(total_steps=total if total is not None else 0),
        payload=DenoiseInput(embeddings=embeddings, height=start.height, width=start.width,
                             num_inference_steps=start.num_inference_steps,
                             true_cfg_scale=start.true_cfg_scale, seed=start.seed,
                             sigmas=sigmas))


def _result(latents: DenoisedLatents) -> pb.DenoiseResult:
    return pb.DenoiseResult(latents=to_proto(latents.latents), height=latents.height,
                            width=latents.width)


WIRE = StageWire(response_cls=pb.DenoiseResponse, make_request=_request, encode_result=_result)


class DitServicer(dit_service_pb2_grpc.DitServiceServicer):
    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine

    async def Denoise(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in serve_stage_stream(self.engine, WIRE, request_iterator, context):
            yield response


def build_stage(model_dir: Path, options: dict[str, Any]) -> StageBundle:
    """options: step_execution (default true) — step-boundary abort on, or request mode."""
    step_execution = bool(options.get("step_execution", True))
    mode = ExecutionMode.STEP if step_execution else ExecutionMode.REQUEST
    engine = StepEngine(DenoiseAdapter(model_dir), mode=mode)
    return StageBundle(
        name="dit", engines=[engine], service_names=[SERVICE_NAME],
        register=lambda server: dit_service_pb2_grpc.add_DitServiceServicer_to_server(
            DitServicer(engine), server),
        info={"model": str(model_dir), "mode": mode.value})
