"""stagemesh.v1.GatewayService in-process: one method per RPC, on the proto messages.

The gRPC servicer (grpc_api.py) and the REST routes derived from the service's
google.api.http annotations (transcoding.py) are thin adapters over this class, so both
transports run the same code, with no loopback hop. Methods raise GatewayError.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from stagemesh.gateway.audio import StreamEncoder
from stagemesh.gateway.chat_pipeline import native_chat
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.events import Done, Output, StageEvent
from stagemesh.gateway.image_params import ImageRequest
from stagemesh.gateway.image_pipeline import GeneratedImage
from stagemesh.gateway.recipes import TASK_STAGES
from stagemesh.gateway.request_ids import check_request_id
from stagemesh.gateway.speech_params import SpeechRequest
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb


def image_request(request: pb.GenerateImageRequest) -> ImageRequest:
    """The proto's zero values mean "not given" (0 = default, unset optional = default)."""
    return ImageRequest(
        prompt=request.prompt, model=request.model,
        negative_prompt=(request.negative_prompt if request.HasField("negative_prompt")
                         else None),
        n=request.n or None, width=request.width or None, height=request.height or None,
        num_inference_steps=request.num_inference_steps or None,
        true_cfg_scale=request.true_cfg_scale if request.HasField("true_cfg_scale") else None,
        seed=request.seed if request.HasField("seed") else None,
        execution_mode=request.execution_mode, priority=request.priority)


def speech_request(request: pb.SynthesizeSpeechRequest) -> SpeechRequest:
    """The proto's zero values mean "not given" (speed 0 = 1.0, empty ref_audio = none)."""
    return SpeechRequest(
        input=request.input, model=request.model, voice=request.voice or None,
        response_format=request.response_format or None, speed=request.speed or None,
        task_type=request.task_type or None, language=request.language,
        instructions=request.instructions, ref_audio=request.ref_audio or None,
        ref_text=request.ref_text, seed=request.seed if request.HasField("seed") else None,
        max_new_tokens=(request.max_new_tokens if request.HasField("max_new_tokens")
                        else None))


def _image_response(request_id: str,
                    item: StageEvent | Output[GeneratedImage] | Done[list[GeneratedImage]]
                    ) -> pb.GenerateImageResponse | None:
    if isinstance(item, StageEvent):
        response = pb.GenerateImageResponse(request_id=request_id, stage=item.stage)
        match item.event:
            case common_pb2.Queued():
                response.queued.CopyFrom(item.event)
            case common_pb2.Preempted():
                response.preempted.CopyFrom(item.event)
            case _:
                response.progress.CopyFrom(item.event)
        return response
    if isinstance(item, Output):
        image = item.value
        return pb.GenerateImageResponse(request_id=request_id, result=pb.GeneratedImages(
            images=[pb.GeneratedImage(png=image.png, seed=image.seed, width=image.width,
                                      height=image.height)]))
    return None


class NativeApi:
    """GatewayService's RPCs on the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def GenerateImage(
        self, request: pb.GenerateImageRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.GenerateImageResponse, None]:
        """Queued and progress events of each stage, then one result per image."""
        job = await self.core.prepare_images(image_request(request))
        context = context.for_request(check_request_id(request.request_id, "request_id"))
        async with contextlib.aclosing(self.core.image_events(job, context)) as items:
            async for item in items:
                response = _image_response(context.request_id, item)
                if response is not None:
                    yield response

    async def SynthesizeSpeech(
        self, request: pb.SynthesizeSpeechRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.SynthesizeSpeechResponse, None]:
        """The same audio bytes as POST /v1/audio/speech with stream=true, one message per
        chunk (a WAV's header rides on the first)."""
        job = await self.core.prepare_speech(speech_request(request))
        context = context.for_request(check_request_id(request.request_id, "request_id"))
        encoder: StreamEncoder | None = None
        async with contextlib.aclosing(self.core.speech_events(job, context)) as items:
            async for item in items:
                if isinstance(item, Output):
                    encoder = encoder or StreamEncoder(job.params.response_format,
                                                       item.value.sample_rate)
                    audio = encoder.chunk(item.value.pcm)
                elif isinstance(item, Done):
                    encoder = encoder or StreamEncoder(job.params.response_format,
                                                       item.result.sample_rate)
                    audio = encoder.end()
                else:
                    continue
                if audio:
                    yield pb.SynthesizeSpeechResponse(request_id=context.request_id, audio=audio,
                                                      sample_rate=encoder.sample_rate)

    def Chat(
        self, request: pb.ChatRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.ChatResponse, None]:
        """Text as the thinker writes it, speech sentence by sentence (chat_pipeline.py)."""
        return native_chat(self.core, request, context)

    async def CancelRequest(
        self, request: pb.CancelRequestRequest, context: RequestContext,
    ) -> pb.CancelRequestResponse:
        outcome = await self.core.cancel(check_request_id(request.request_id, "request_id"),
                                         owner=context.owner)
        return pb.CancelRequestResponse(
            request_id=outcome.request_id, state=outcome.state, stage=outcome.stage,
            step_index=outcome.step_index, abort_latency_seconds=outcome.abort_latency_seconds)

    async def ListStages(
        self, request: pb.ListStagesRequest, context: RequestContext,
    ) -> pb.ListStagesResponse:
        return pb.ListStagesResponse(stages=await self.core.stage_infos())

    async def ListRecipes(
        self, request: pb.ListRecipesRequest, context: RequestContext,
    ) -> pb.ListRecipesResponse:
        return pb.ListRecipesResponse(recipes=[
            pb.RecipeInfo(name=r.name, task=r.task.value, stages=list(TASK_STAGES[r.task]))
            for r in self.core.recipes.values()])
