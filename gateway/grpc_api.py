"""The public gRPC API (stagemesh.v1.GatewayService)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.events import Done, Output, StageEvent, stream_pipeline
from stagemesh.gateway.images import generate_images, validate_image_params
from stagemesh.gateway.mesh import Mesh
from stagemesh.gateway.recipes import TASK_STAGES, Task
from stagemesh.gateway.speech import (
    StreamEncoder,
    recipe_voices,
    synthesize,
    validate_speech_params,
)
from stagemesh.shared.errors import build_status
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, error: GatewayError) -> None:
    await context.abort_with_status(build_status(error.code, error.message, reason=error.reason,
                                                 field_name=error.field_name))


class GatewayServicer(gateway_service_pb2_grpc.GatewayServiceServicer):
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    async def GenerateImage(
        self, request: pb.GenerateImageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateImageResponse]:
        try:
            recipe = self.mesh.recipe(request.model, Task.TEXT_TO_IMAGE)
            params = validate_image_params(
                recipe, prompt=request.prompt,
                negative_prompt=(request.negative_prompt
                                 if request.HasField("negative_prompt") else None),
                n=request.n or None, width=request.width or None,
                height=request.height or None,
                num_inference_steps=request.num_inference_steps or None,
                true_cfg_scale=(request.true_cfg_scale
                                if request.HasField("true_cfg_scale") else None),
                seed=request.seed if request.HasField("seed") else None,
                execution_mode=request.execution_mode)
            async with self.mesh.request_scope(recipe, request.request_id,
                                               context.time_remaining()) as scope:
                async for item in stream_pipeline(
                    lambda emit: generate_images(recipe, params, scope, self.mesh.stubs(recipe),
                                                 emit)):
                    response = _image_response(scope.request_id, item)
                    if response is not None:
                        yield response
        except GatewayError as error:
            await _abort(context, error)

    async def SynthesizeSpeech(
        self, request: pb.SynthesizeSpeechRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SynthesizeSpeechResponse]:
        """The same audio bytes as POST /v1/audio/speech with stream=true, one message per
        chunk (a WAV's header rides on the first)."""
        try:
            recipe = self.mesh.recipe(request.model, Task.TEXT_TO_SPEECH)
            params = await asyncio.to_thread(  # decoding ref_audio is CPU work
                validate_speech_params,
                recipe, input=request.input, voices=await asyncio.to_thread(recipe_voices, recipe),
                voice=request.voice or None, response_format=request.response_format or None,
                speed=request.speed or None, task_type=request.task_type or None,
                language=request.language, instructions=request.instructions,
                ref_audio=request.ref_audio or None, ref_text=request.ref_text,
                seed=request.seed if request.HasField("seed") else None,
                max_new_tokens=(request.max_new_tokens
                                if request.HasField("max_new_tokens") else None))
            async with self.mesh.request_scope(recipe, request.request_id,
                                               context.time_remaining()) as scope:
                encoder: StreamEncoder | None = None
                async for item in stream_pipeline(
                    lambda emit: synthesize(recipe, params, scope, self.mesh.stubs(recipe),
                                            emit)):
                    if isinstance(item, Output):
                        piece = item.value
                        encoder = encoder or StreamEncoder(params.response_format,
                                                           piece.sample_rate)
                        audio = encoder.chunk(piece.pcm)
                    elif isinstance(item, Done):
                        encoder = encoder or StreamEncoder(params.response_format,
                                                           item.result.sample_rate)
                        audio = encoder.end()
                    else:
                        continue
                    if audio:
                        yield pb.SynthesizeSpeechResponse(request_id=scope.request_id,
                                                          audio=audio,
                                                          sample_rate=encoder.sample_rate)
        except GatewayError as error:
            await _abort(context, error)

    async def CancelRequest(
        self, request: pb.CancelRequestRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelRequestResponse:
        try:
            outcome = await self.mesh.cancel(request.request_id)
        except GatewayError as error:
            await _abort(context, error)
        return pb.CancelRequestResponse(
            request_id=outcome.request_id, state=outcome.state, stage=outcome.stage,
            step_index=outcome.step_index, abort_latency_seconds=outcome.abort_latency_seconds)

    async def ListStages(
        self, request: pb.ListStagesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListStagesResponse:
        return pb.ListStagesResponse(stages=await self.mesh.stage_infos())

    async def ListRecipes(
        self, request: pb.ListRecipesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRecipesResponse:
        return pb.ListRecipesResponse(recipes=[
            pb.RecipeInfo(name=r.name, task=r.task.value, stages=list(TASK_STAGES[r.task]))
            for r in self.mesh.recipes.values()])


def _image_response(request_id: str, item: object) -> pb.GenerateImageResponse | None:
    if isinstance(item, StageEvent):
        kind = item.response.WhichOneof("event")
        if kind not in ("queued", "progress"):
            return None
        return pb.GenerateImageResponse(request_id=request_id, stage=item.stage,
                                        **{kind: getattr(item.response, kind)})
    if isinstance(item, Output):
        image = item.value
        return pb.GenerateImageResponse(request_id=request_id, result=pb.GeneratedImages(
            images=[pb.GeneratedImage(png=image.png, seed=image.seed, width=image.width,
                                      height=image.height)]))
    assert isinstance(item, Done)
    return None
