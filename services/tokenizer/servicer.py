"""Tokenizer stage servicer: EncodePrompt over the PromptEncoderAdapter."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from stagemesh.services.tokenizer.adapter import (
    DEFAULT_MAX_SEQUENCE_LENGTH,
    PromptEmbeddings,
    PromptEncoderAdapter,
    PromptInput,
)
from stagemesh.shared.engine.adapter import EngineRequest
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.proto.v1 import tokenizer_service_pb2 as pb
from stagemesh.shared.proto.v1 import tokenizer_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.torch_tensors import optional_to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TokenizerService"].full_name


def _request(start: pb.EncodePromptStart, deadline: float | None) -> EngineRequest:
    negative = start.negative_prompt if start.HasField("negative_prompt") else None
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        payload=PromptInput(prompt=start.prompt, negative_prompt=negative,
                            max_sequence_length=(start.max_sequence_length
                                                 or DEFAULT_MAX_SEQUENCE_LENGTH)))


def _result(embeddings: PromptEmbeddings) -> pb.EncodePromptResult:
    return pb.EncodePromptResult(
        prompt_embeds=optional_to_proto(embeddings.prompt_embeds),
        prompt_embeds_mask=optional_to_proto(embeddings.prompt_embeds_mask),
        negative_prompt_embeds=optional_to_proto(embeddings.negative_prompt_embeds),
        negative_prompt_embeds_mask=optional_to_proto(embeddings.negative_prompt_embeds_mask))


WIRE = StageWire(response_cls=pb.EncodePromptResponse, make_request=_request,
                 encode_result=_result)


class TokenizerServicer(tokenizer_service_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine

    async def EncodePrompt(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in serve_stage_stream(self.engine, WIRE, request_iterator, context):
            yield response


def build_stage(model_dir: Path, options: dict[str, Any]) -> StageBundle:
    engine = StepEngine(PromptEncoderAdapter(model_dir))
    return StageBundle(
        name="tokenizer", engines=[engine], service_names=[SERVICE_NAME],
        register=lambda server: tokenizer_service_pb2_grpc.add_TokenizerServiceServicer_to_server(
            TokenizerServicer(engine), server),
        info={"model": str(model_dir)})
