"""stagemesh.v1.GatewayService in-process: one method per RPC, on the proto messages.

The gRPC servicer (api.py) and the REST routes derived from the service's
google.api.http annotations (transcoding.py) are thin adapters over this class, so both
transports run the same code, with no loopback hop. Methods raise GatewayError.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from functools import partial
from typing import TypeVar

from google.protobuf import json_format

from stagemesh.gateway.chat.pipeline import native_chat
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.images.edit_protocol import EditRequest
from stagemesh.gateway.images.pipeline import (
    GeneratedImage,
    ImageEvents,
    edit_events,
    image_events,
    prepare_edit,
    prepare_images,
)
from stagemesh.gateway.images.protocol import ImageRequest, PreviewAsk
from stagemesh.gateway.loras.pipeline import list_adapters, load_adapter, unload_adapter
from stagemesh.gateway.loras.protocol import load_update, unload_update
from stagemesh.gateway.mesh.events import Done, Output, StageEvent
from stagemesh.gateway.mesh.stages import lora_from_proto
from stagemesh.gateway.recipes import TASK_STAGES
from stagemesh.gateway.request_ids import check_request_id
from stagemesh.gateway.speech.audio import StreamEncoder
from stagemesh.gateway.speech.pipeline import prepare_speech, speech_events
from stagemesh.gateway.speech.protocol import SpeechRequest
from stagemesh.gateway.transcriptions.pipeline import prepare_transcription, transcript_events
from stagemesh.gateway.transcriptions.protocol import TranscriptionRequest
from stagemesh.gateway.videos.jobs import new_video_id, page, video_jobs
from stagemesh.gateway.videos.pipeline import prepare_video
from stagemesh.gateway.videos.protocol import VideoRequest
from stagemesh.gateway.videos.store import JobRecord, JobStatus
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb

J = TypeVar("J")


def image_request(request: pb.GenerateImageRequest | pb.EditImageRequest) -> ImageRequest:
    """The proto's zero values mean "not given" (0 = default, unset optional = default; an
    edit's 0 x 0 size: the size derived from its input image). An edit has no execution mode
    or priority."""
    generate = request if isinstance(request, pb.GenerateImageRequest) else None
    return ImageRequest(
        prompt=request.prompt, model=request.model,
        negative_prompt=(request.negative_prompt if request.HasField("negative_prompt")
                         else None),
        n=request.n or None, width=request.width or None, height=request.height or None,
        num_inference_steps=request.num_inference_steps or None,
        true_cfg_scale=request.true_cfg_scale if request.HasField("true_cfg_scale") else None,
        seed=request.seed if request.HasField("seed") else None,
        execution_mode=(generate.execution_mode if generate
                        else common_pb2.EXECUTION_MODE_UNSPECIFIED),
        priority=generate.priority if generate else None,
        step_cache_threshold=(request.step_cache_threshold
                              if request.HasField("step_cache_threshold") else None),
        preview=preview_ask(request), lora=lora_from_proto(request.lora))


def preview_ask(request: pb.GenerateImageRequest | pb.EditImageRequest | pb.CreateVideoRequest
                ) -> PreviewAsk | None:
    """The request's `preview` (size 0: the DiT's default); unset: none."""
    if not request.HasField("preview"):
        return None
    return PreviewAsk(request.preview.every, request.preview.size or None)


def edit_request(request: pb.EditImageRequest) -> EditRequest:
    return EditRequest(image=image_request(request), images=tuple(request.images))


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


async def _image_stream(prepare: Callable[[], Awaitable[J]],
                        events: Callable[[J, RequestContext], ImageEvents], request_id: str,
                        context: RequestContext
                        ) -> AsyncGenerator[pb.GenerateImageResponse, None]:
    """An image request (generate or edit) as GenerateImageResponses: prepared first (a bad
    field fails before any response), then each stage event and each image."""
    job = await prepare()
    context = context.for_request(check_request_id(request_id, "request_id"))
    async with contextlib.aclosing(events(job, context)) as items:
        async for item in items:
            response = _image_response(context.request_id, item)
            if response is not None:
                yield response


class NativeApi:
    """GatewayService's RPCs on the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.videos = video_jobs(core)

    def GenerateImage(
        self, request: pb.GenerateImageRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.GenerateImageResponse, None]:
        """Queued and progress events of each stage, then one result per image."""
        return _image_stream(lambda: prepare_images(self.core, image_request(request)),
                             partial(image_events, self.core), request.request_id, context)

    async def SynthesizeSpeech(
        self, request: pb.SynthesizeSpeechRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.SynthesizeSpeechResponse, None]:
        """The same audio bytes as POST /v1/audio/speech with stream=true, one message per
        chunk (a WAV's header rides on the first)."""
        job = await prepare_speech(self.core, speech_request(request))
        context = context.for_request(check_request_id(request.request_id, "request_id"))
        encoder: StreamEncoder | None = None
        async with contextlib.aclosing(speech_events(self.core, job, context)) as items:
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

    async def TranscribeAudio(
        self, request: pb.TranscribeAudioRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.TranscribeAudioResponse, None]:
        """What POST /v1/audio/transcriptions streams: each final segment, then the whole
        transcript (transcriptions/pipeline.py)."""
        job = await prepare_transcription(self.core, TranscriptionRequest(
            audio=request.audio, model=request.model,
            language=request.language.strip().lower(), prompt=request.prompt))
        context = context.for_request(check_request_id(request.request_id, "request_id"))
        async with contextlib.aclosing(transcript_events(self.core, job, context)) as items:
            async for item in items:
                if isinstance(item, Output):
                    s = item.value
                    yield pb.TranscribeAudioResponse(
                        request_id=context.request_id, segment=pb.TranscribedSegment(
                            index=s.index, text=s.text, start_ms=s.start_ms, end_ms=s.end_ms,
                            no_speech_prob=s.no_speech_prob))
                elif isinstance(item, Done):
                    yield pb.TranscribeAudioResponse(
                        request_id=context.request_id, result=pb.TranscribeAudioResult(
                            text=item.result.text, duration_seconds=item.result.seconds,
                            language=item.result.language))

    def Chat(
        self, request: pb.ChatRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.ChatResponse, None]:
        """Text as the thinker writes it, speech sentence by sentence (chat/pipeline.py)."""
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

    # -- LoRA adapters (gateway/loras/; the servicer lets only admin keys load and unload) ----

    async def LoadLora(self, request: pb.LoadLoraRequest, context: RequestContext
                       ) -> pb.LoadLoraResponse:
        update = load_update(request.lora_name, request.lora_path, request.model)
        return pb.LoadLoraResponse(lora_name=update.lora_name,
                                   models=await load_adapter(self.core, update))

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: RequestContext
                         ) -> pb.UnloadLoraResponse:
        update = unload_update(request.lora_name, request.model)
        return pb.UnloadLoraResponse(lora_name=update.lora_name,
                                     models=await unload_adapter(self.core, update))

    async def ListLoras(self, request: pb.ListLorasRequest, context: RequestContext
                        ) -> pb.ListLorasResponse:
        return pb.ListLorasResponse(recipes=[json_format.ParseDict(row, pb.RecipeLoras())
                                             for row in await list_adapters(self.core)])

    def EditImage(
        self, request: pb.EditImageRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.GenerateImageResponse, None]:
        """Like GenerateImage, on an image-edit recipe: the instruction and the image(s) to
        edit (images/pipeline.py)."""
        return _image_stream(lambda: prepare_edit(self.core, edit_request(request)),
                             lambda job, c: edit_events(self.core, job, c),
                             request.request_id, context)


    # -- video jobs (AIP-151: the job is the resource; videos/jobs.py) ------------------

    async def CreateVideo(self, request: pb.CreateVideoRequest,
                          context: RequestContext) -> pb.VideoJob:
        """Check the request (400 before anything is stored), store the job queued, start it."""
        spec = await prepare_video(self.core, video_request(request))
        job_id = check_request_id(request.request_id, "request_id") or new_video_id()
        return video_job(await self.videos.create(spec, job_id, context.owner))

    async def GetVideo(self, request: pb.GetVideoRequest, context: RequestContext) -> pb.VideoJob:
        return video_job(await self.videos.get(context.owner, request.id))

    async def ListVideos(self, request: pb.ListVideosRequest,
                         context: RequestContext) -> pb.ListVideosResponse:
        """Newest first; `next_page_token` is the last job's id (empty on the last page)."""
        records = await self.videos.owned(context.owner)
        jobs, more = page(records, request.page_size or None, request.page_token, "page_size",
                          "page_token")
        return pb.ListVideosResponse(jobs=[video_job(r) for r in jobs],
                                     next_page_token=jobs[-1].id if more else "")

    async def DeleteVideo(self, request: pb.DeleteVideoRequest,
                          context: RequestContext) -> pb.VideoJob:
        return video_job(await self.videos.delete(context.owner, request.id))

    async def WatchVideo(self, request: pb.WatchVideoRequest,
                         context: RequestContext) -> AsyncGenerator[pb.VideoJob, None]:
        async with contextlib.aclosing(self.videos.watch(context.owner,
                                                              request.id)) as records:
            async for view in records:
                yield video_job(view.record, view.preview)

    async def DownloadVideo(
        self, request: pb.DownloadVideoRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.DownloadVideoResponse, None]:
        async with contextlib.aclosing(self.videos.chunks(context.owner,
                                                               request.id)) as chunks:
            async for chunk in chunks:
                yield pb.DownloadVideoResponse(data=chunk)


def video_request(request: pb.CreateVideoRequest) -> VideoRequest:
    """The proto's zero values mean "not given" (0 = default, unset optional = default)."""
    return VideoRequest(
        prompt=request.prompt, model=request.model,
        negative_prompt=(request.negative_prompt if request.HasField("negative_prompt")
                         else None),
        width=request.width or None, height=request.height or None,
        num_frames=request.num_frames or None, seconds=request.seconds or None,
        fps=request.fps or None, num_inference_steps=request.num_inference_steps or None,
        guidance_scale=(request.guidance_scale if request.HasField("guidance_scale")
                        else None),
        guidance_scale_2=(request.guidance_scale_2 if request.HasField("guidance_scale_2")
                          else None),
        boundary_ratio=(request.boundary_ratio if request.HasField("boundary_ratio")
                        else None),
        flow_shift=request.flow_shift if request.HasField("flow_shift") else None,
        seed=request.seed if request.HasField("seed") else None,
        step_cache_threshold=(request.step_cache_threshold
                              if request.HasField("step_cache_threshold") else None),
        image=request.input_reference or None, lora=lora_from_proto(request.lora),
        preview=preview_ask(request))


#: A job's state as the proto names it.
JOB_STATES: dict[JobStatus, pb.VideoJobState.ValueType] = {
    JobStatus.QUEUED: pb.VIDEO_JOB_STATE_QUEUED,
    JobStatus.IN_PROGRESS: pb.VIDEO_JOB_STATE_RUNNING,
    JobStatus.COMPLETED: pb.VIDEO_JOB_STATE_SUCCEEDED,
    JobStatus.FAILED: pb.VIDEO_JOB_STATE_FAILED,
    JobStatus.CANCELLED: pb.VIDEO_JOB_STATE_CANCELLED,
}


def video_job(record: JobRecord, preview: common_pb2.Preview | None = None) -> pb.VideoJob:
    """The job as the API shows it (a watch adds its latest step preview)."""
    return pb.VideoJob(
        id=record.id, model=record.model, state=JOB_STATES[record.status],
        progress=record.progress, create_time=int(record.created_at),
        complete_time=int(record.completed_at or 0), width=record.width, height=record.height,
        num_frames=record.num_frames, fps=record.fps, error=record.error,
        size_bytes=record.size_bytes, prompt=record.prompt, preview=preview)
