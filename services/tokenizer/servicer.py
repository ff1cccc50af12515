"""Tokenizer stage servicer: EncodePrompt over the model family's adapter, and its limits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TypeAlias

import grpc
import numpy as np

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.tokenizer.base import (
    CPU_DTYPE,
    DEFAULT_MAX_RUNNING,
    PromptAdapterBase,
    PromptInput,
    PromptState,
    RgbArray,
    TokenizerLimits,
)
from stagemesh.services.tokenizer.families import TokenizerOptions, build_adapter, family_of
from stagemesh.shared.devices import DeviceOptions, resolve_placement
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, NoStream
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.scheduler import BURST_ADMISSION_WINDOW_SECONDS
from stagemesh.shared.options import parse_options
from stagemesh.shared.proto.v1 import tokenizer_service_pb2 as pb
from stagemesh.shared.proto.v1 import tokenizer_service_pb2_grpc
from stagemesh.shared.quantization import Quantization, QuantizationOptions, quantize
from stagemesh.shared.quantization import from_options as quantization_from_options
from stagemesh.shared.stage_runtime import StageBundle, servicer_bundle, stage_description
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.tensors import TensorDecodeError, array_from_proto
from stagemesh.shared.torch_tensors import optional_to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TokenizerService"].full_name

TokenizerEngine: TypeAlias = StepEngine[
    PromptInput, NoStream, PromptState, NoStream, PromptEmbeddings
]


def _request(message: pb.EncodePromptRequest, deadline: float | None) -> EngineRequest[PromptInput]:
    start = message.start
    negative = start.negative_prompt if start.HasField("negative_prompt") else None
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        payload=PromptInput(prompt=start.prompt, negative_prompt=negative,
                            # 0 (unset) = the stage's limit
                            max_sequence_length=start.max_sequence_length or None,
                            images=_images(start)))


def _images(start: pb.EncodePromptStart) -> tuple[RgbArray, ...]:
    """The start's images as uint8 arrays; their count and shapes are the adapter's checks.
    The bytes are bounded by the stage's message size, so decoding them here is cheap."""
    arrays: list[RgbArray] = []
    for index, tensor in enumerate(start.images):
        try:
            array = array_from_proto(tensor)
        except TensorDecodeError as error:
            raise InvalidInputError("images", f"images[{index}]: {error}") from error
        if array.dtype != np.uint8:
            raise InvalidInputError("images", f"images[{index}] must be uint8, got {array.dtype}")
        arrays.append(array.view(np.uint8))
    return tuple(arrays)


#: Bytes a start message has besides its two prompts (request id, small fields, framing).
MESSAGE_OVERHEAD_BYTES = 4096
#: Bytes an image tensor has besides its pixels (dtype, shape, framing).
IMAGE_OVERHEAD_BYTES = 64


def max_request_bytes(max_prompt_chars: int, max_images: int = 0, max_image_pixels: int = 0) -> int:
    """The largest legal EncodePrompt message: a prompt and a negative prompt of
    `max_prompt_chars` characters each, at most 4 UTF-8 bytes a character, and the images at
    3 bytes a pixel. The server refuses a bigger message before parsing it (a 20 MB prompt
    costs nothing)."""
    images = max_images * (3 * max_image_pixels + IMAGE_OVERHEAD_BYTES)
    return 2 * 4 * max_prompt_chars + images + MESSAGE_OVERHEAD_BYTES


def _result(embeddings: PromptEmbeddings) -> pb.EncodePromptResult:
    return pb.EncodePromptResult(
        prompt_embeds=optional_to_proto(embeddings.prompt_embeds),
        prompt_embeds_mask=optional_to_proto(embeddings.prompt_embeds_mask),
        negative_prompt_embeds=optional_to_proto(embeddings.negative_prompt_embeds),
        negative_prompt_embeds_mask=optional_to_proto(embeddings.negative_prompt_embeds_mask))


WIRE: StageWire[pb.EncodePromptRequest, pb.EncodePromptResponse, PromptInput, NoStream, NoStream,
                PromptEmbeddings] = StageWire(
    response_cls=pb.EncodePromptResponse, make_request=_request, encode_result=_result)


class TokenizerServicer(tokenizer_service_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, engine: TokenizerEngine, description: pb.DescribeTokenizerResponse) -> None:
        self.engine = engine
        self.description = description

    async def EncodePrompt(
        self,
        request_iterator: AsyncIterator[pb.EncodePromptRequest],
        context: grpc.aio.ServicerContext[pb.EncodePromptRequest, pb.EncodePromptResponse],
    ) -> AsyncIterator[pb.EncodePromptResponse]:
        async for response in serve_stage_stream(self.engine, WIRE, request_iterator, context):
            yield response

    async def DescribeTokenizer(
        self,
        request: pb.DescribeTokenizerRequest,
        context: grpc.aio.ServicerContext[
            pb.DescribeTokenizerRequest, pb.DescribeTokenizerResponse
        ],
    ) -> pb.DescribeTokenizerResponse:
        return self.description


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """options: TokenizerOptions (each capped by the model) and DeviceOptions. The folder's
    pipeline class picks the adapter (`families`)."""
    limit_options, quantization_options, device_options = parse_options(
        "tokenizer", options, TokenizerOptions, QuantizationOptions, DeviceOptions)
    placement = resolve_placement("tokenizer", device_options, CPU_DTYPE)
    # checked before the model loads: fp8 on a device without it stops here
    quantization = quantization_from_options("tokenizer", quantization_options, placement.device)
    adapter = build_adapter(model_dir, limit_options, placement)
    quantize([adapter.text_encoder], quantization)
    return stage_bundle(adapter, model_dir, quantization)


def stage_bundle(adapter: PromptAdapterBase, model_dir: Path,
                 quantization: Quantization = Quantization.NONE) -> StageBundle:
    """The stage around a loaded adapter (of `model_dir`, its text encoder quantized with
    `quantization`): its engine, servicer and limits."""
    placement = adapter.placement
    engine: TokenizerEngine = StepEngine(adapter, max_running=DEFAULT_MAX_RUNNING,
                                         admission_window=BURST_ADMISSION_WINDOW_SECONDS)
    limits = adapter.limits
    description = pb.DescribeTokenizerResponse(
        stage=stage_description("tokenizer", model_dir, engine, placement),
        max_prompt_chars=limits.max_prompt_chars, max_sequence_length=limits.max_sequence_length,
        max_images=limits.max_images, max_image_pixels=limits.max_image_pixels,
        quantization=quantization.value)
    servicer = TokenizerServicer(engine, description)
    return servicer_bundle(
        "tokenizer", model_dir, [engine], servicer,
        tokenizer_service_pb2_grpc.add_TokenizerServiceServicer_to_server, SERVICE_NAME,
        {"family": family_of(model_dir).value, **placement.facts(), **_limit_facts(limits),
         "quantization": quantization.value},
        max_receive_bytes=max_request_bytes(limits.max_prompt_chars, limits.max_images,
                                            limits.max_image_pixels))


def _limit_facts(limits: TokenizerLimits) -> dict[str, str]:
    facts = {"max_prompt_chars": str(limits.max_prompt_chars),
             "max_sequence_length": str(limits.max_sequence_length)}
    if limits.max_images:
        facts |= {"max_images": str(limits.max_images),
                  "max_image_pixels": str(limits.max_image_pixels)}
    return facts
