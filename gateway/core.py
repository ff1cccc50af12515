"""The gateway's work, written once: every transport (OpenAI REST, native REST, gRPC) calls it.

A request is prepared first (recipe chosen, stage facts read, every field checked: a bad field
is refused before any stage runs and before a streamed response starts), then run inside its
CancelScope, which turns every failure into a GatewayError.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace

import grpc

from stagemesh.gateway.errors import GatewayError, InvalidRequest, StageUnavailable
from stagemesh.gateway.images.pipeline import GeneratedImage, generate_images
from stagemesh.gateway.images.protocol import ImageParams, ImageRequest, resolve_image_request
from stagemesh.gateway.mesh.cancel import (
    CancelOutcome,
    CancelScope,
    DeadlineExceeded,
    RequestCancelled,
    ScopeRegistry,
    new_request_id,
    stage_request_id,
)
from stagemesh.gateway.mesh.catalog import StageCatalog
from stagemesh.gateway.mesh.channels import Mesh, StageCancel
from stagemesh.gateway.mesh.events import Done, Emit, Output, StageEvent, stream_pipeline
from stagemesh.gateway.mesh.stage_client import StageCallError
from stagemesh.gateway.recipes import VIDEO_TASKS, Recipe, Task
from stagemesh.gateway.speech.pipeline import AudioPiece, SpeechSummary, synthesize, synthesize_all
from stagemesh.gateway.speech.protocol import SpeechParams, SpeechRequest, resolve_speech_request
from stagemesh.gateway.videos.jobs import VideoJobs
from stagemesh.gateway.videos.mux import Mp4Writer, check_encoder
from stagemesh.gateway.videos.pipeline import FrameSink, Mp4Sink, OnProgress, VideoSummary
from stagemesh.gateway.videos.pipeline import make_video as run_video_pipeline
from stagemesh.gateway.videos.protocol import VideoParams, VideoRequest, resolve_video_request
from stagemesh.gateway.videos.store import StoreLimits, VideoStore, default_root
from stagemesh.shared.logs import request_id_var
from stagemesh.shared.proto.v1 import common_pb2, control_service_pb2, gateway_service_pb2

CANCEL_PENDING = control_service_pb2.CANCEL_STAGE_OUTCOME_PENDING
CANCEL_STOPPED = control_service_pb2.CANCEL_STAGE_OUTCOME_STOPPED

#: Every request gets a deadline: this one when the client gives none.
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 3600.0


ImageEvents = AsyncGenerator[
    StageEvent | Output[GeneratedImage] | Done[list[GeneratedImage]], None]
SpeechEvents = AsyncGenerator[StageEvent | Output[AudioPiece] | Done[SpeechSummary], None]


@dataclass(frozen=True)
class RequestContext:
    """What the transport knows about a request: its id and its time budget."""

    request_id: str
    timeout: float | None = None  # seconds; None = DEFAULT_TIMEOUT_S
    #: Who started the request: the owner id of the caller's API key ("" with auth off).
    owner: str = ""

    @classmethod
    def create(cls, request_id: str | None, timeout: float | None,
               owner: str = "") -> RequestContext:
        """Check the client's timeout; an empty id gets a new one."""
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
            raise InvalidRequest("timeout", f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds")
        return cls(request_id or new_request_id(), timeout, owner)

    def for_request(self, request_id: str) -> RequestContext:
        """The id a request message carries wins over the transport's."""
        return replace(self, request_id=request_id) if request_id else self


@dataclass(frozen=True)
class ImageJob:
    """A checked image request and the recipe that runs it."""

    recipe: Recipe
    params: ImageParams


@dataclass(frozen=True)
class SpeechJob:
    """A checked speech request and the recipe that runs it."""

    recipe: Recipe
    params: SpeechParams


@dataclass(frozen=True)
class VideoSpec:
    """A checked video request and the recipe that runs it."""

    recipe: Recipe
    params: VideoParams


class GatewayCore:
    """Prepare, run and cancel requests on a started Mesh and StageCatalog."""

    def __init__(self, mesh: Mesh, catalog: StageCatalog,
                 video_store: VideoStore | None = None) -> None:
        self.mesh = mesh
        self.catalog = catalog
        self.scopes = ScopeRegistry()
        #: Video jobs, in STAGEMESH_VIDEO_STORE (nothing is read or written before a job).
        self.videos = VideoJobs(self, video_store or VideoStore(
            default_root(os.environ), StoreLimits.from_env(os.environ)))

    @property
    def recipes(self) -> dict[str, Recipe]:
        return self.mesh.recipes

    # -- images --------------------------------------------------------------------------------

    async def prepare_images(self, request: ImageRequest) -> ImageJob:
        recipe = self.mesh.recipe(request.model, Task.TEXT_TO_IMAGE)
        facts = await self.catalog.image_facts(recipe)
        return ImageJob(recipe, resolve_image_request(request, recipe.image_defaults, facts))

    async def generate_images(self, job: ImageJob, context: RequestContext,
                              emit: Emit[GeneratedImage] | None = None) -> list[GeneratedImage]:
        async with self.request_scope(job.recipe, context, parts=job.params.n) as scope:
            return await generate_images(job.params, scope, self.mesh.image_stubs(job.recipe),
                                         emit)

    def image_events(self, job: ImageJob, context: RequestContext) -> ImageEvents:
        """generate_images as a stream: stage progress, each image, then Done."""

        async def run(emit: Emit[GeneratedImage]) -> list[GeneratedImage]:
            return await self.generate_images(job, context, emit)

        return stream_pipeline(run)

    # -- speech --------------------------------------------------------------------------------

    async def prepare_speech(self, request: SpeechRequest) -> SpeechJob:
        recipe = self.mesh.recipe(request.model, Task.TEXT_TO_SPEECH)
        facts = await self.catalog.speech_facts(recipe)
        # Decoding a reference clip is CPU work: keep it off the event loop.
        params = await asyncio.to_thread(resolve_speech_request, request, facts)
        return SpeechJob(recipe, params)

    async def synthesize(self, job: SpeechJob, context: RequestContext,
                         emit: Emit[AudioPiece]) -> SpeechSummary:
        async with self.request_scope(job.recipe, context) as scope:
            return await synthesize(job.params, scope, self.mesh.speech_stubs(job.recipe), emit)

    def speech_events(self, job: SpeechJob, context: RequestContext) -> SpeechEvents:
        """synthesize as a stream: each audio chunk, then Done with the summary."""

        async def run(emit: Emit[AudioPiece]) -> SpeechSummary:
            return await self.synthesize(job, context, emit)

        return stream_pipeline(run)

    async def synthesize_all(self, job: SpeechJob, context: RequestContext) -> bytes:
        async with self.request_scope(job.recipe, context) as scope:
            audio, _ = await synthesize_all(job.params, scope,
                                            self.mesh.speech_stubs(job.recipe))
            return audio

    async def voices(self, model: str | None) -> tuple[Recipe, list[str]]:
        """The voices of a speech recipe, as its talker publishes them."""
        recipe = self.mesh.recipe(model, Task.TEXT_TO_SPEECH)
        talker = await self.catalog.read(self.catalog.talker, recipe)
        return recipe, list(talker.voices)

    # -- video ---------------------------------------------------------------------------------

    async def prepare_video(self, request: VideoRequest) -> VideoSpec:
        """The recipe (`model`, else the default text-to-video one, or image-to-video with an
        input image) and the checked request; 503 before any stage runs when this gateway
        cannot write MP4s."""
        chosen = self.recipes.get(request.model)
        if chosen is None or chosen.task not in VIDEO_TASKS:
            chosen = self.mesh.recipe(request.model, Task.IMAGE_TO_VIDEO if request.image
                                      is not None else Task.TEXT_TO_VIDEO)
        recipe = chosen
        facts = await self.catalog.video_facts(recipe)
        # Decoding an input image is CPU work: keep it off the event loop.
        params = await asyncio.to_thread(resolve_video_request, request, recipe.video_defaults,
                                         facts)
        await asyncio.to_thread(check_encoder)
        return VideoSpec(recipe, params)

    async def make_video(self, spec: VideoSpec, context: RequestContext, sink: FrameSink,
                         on_progress: OnProgress) -> VideoSummary:
        async with self.request_scope(spec.recipe, context) as scope:
            return await run_video_pipeline(spec.params, scope, self.mesh.image_stubs(spec.recipe),
                                            sink, on_progress)

    async def video_bytes(self, spec: VideoSpec, context: RequestContext) -> bytes:
        """The whole MP4 of a video nobody stores (POST /v1/videos/sync), muxed in memory."""
        buffer = io.BytesIO()
        params = spec.params
        writer = await asyncio.to_thread(Mp4Writer, buffer, params.width, params.height,
                                         params.fps)

        async def ignore(stage: str, fraction: float) -> None:
            return None

        try:
            await self.make_video(spec, context, Mp4Sink(writer), ignore)
            await asyncio.to_thread(writer.close)
        except BaseException:
            await asyncio.to_thread(writer.abort)
            raise
        return buffer.getvalue()

    def job_context(self, job_id: str, owner: str, timeout: float) -> RequestContext:
        """A background job's context: its id is the job's, its owner the creator's."""
        return RequestContext(job_id, timeout, owner)

    # -- control -------------------------------------------------------------------------------

    async def stage_infos(self) -> list[gateway_service_pb2.StageInfo]:
        """Every stage's health, plus the device and dtype it published (empty if unreadable)."""
        infos = await self.mesh.stage_infos()
        descriptions = await asyncio.gather(
            *(self.catalog.description(endpoint) for endpoint in self.mesh.row_endpoints()))
        for info, description in zip(infos, descriptions, strict=True):
            if description is not None:
                info.device, info.dtype = description.device, description.dtype
        return infos

    async def cancel(self, request_id: str, reason: str = "cancelled by id",
                     owner: str = "") -> CancelOutcome:
        """Cancel a request by id, wherever it runs, if `owner` (the caller's API key owner;
        "" with keys off) started it; otherwise it is not found.

        A request this gateway runs is stopped through its own stage streams. Any other (run
        by another gateway replica) is stopped by a cancel sent to every replica of every
        stage (shared/control.py): the replica holding it stops it and answers. A replica not
        holding it keeps the cancel pending for a minute, so a request between two stages
        stops when it reaches the next one; the answer is then NOT_FOUND, as for an id no
        stage knows. A video job's id is its request id: one queued here never starts, and one
        another gateway runs is also marked in the shared store (video_jobs.py), so it stops
        even while it waits between stages.
        """
        scope = self.scopes.get(request_id, owner)
        if scope is not None:
            return await scope.cancel(reason)
        # a video job queued here, or live on another gateway sharing the store (video_jobs.py)
        job = await self.videos.cancel(owner, request_id, reason)
        if job is not None and job.stopped:
            return job.outcome
        try:
            return await self.cancel_remote(request_id, reason, owner)
        except GatewayError:
            if job is None:
                raise
            return job.outcome  # marked: its gateway stops it before its next stage or step

    async def cancel_remote(self, request_id: str, reason: str, owner: str) -> CancelOutcome:
        """Cancel a request another gateway runs: sent to every replica of every stage;
        NOT_FOUND when no replica holds it (see `cancel`)."""
        # the stages know the request by its owner-qualified id (cancel.stage_request_id)
        replies = await self.mesh.cancel_everywhere(stage_request_id(request_id, owner), reason,
                                                    owner)
        outcome = remote_outcome(request_id, self.mesh, replies)
        if outcome is None:
            raise GatewayError(grpc.StatusCode.NOT_FOUND,
                               f"no running request with id {request_id!r}", "request_id")
        return outcome

    @contextlib.asynccontextmanager
    async def request_scope(self, recipe: Recipe, context: RequestContext,
                            parts: int = 1) -> AsyncIterator[CancelScope]:
        """Open a CancelScope (for a request of `parts` stage requests, e.g. n images) and turn
        every failure inside into a GatewayError."""
        try:
            scope = self.scopes.open(context.request_id, context.timeout or DEFAULT_TIMEOUT_S,
                                     parts, context.owner)
        except KeyError:
            raise GatewayError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request id {context.request_id!r} is already in use",
                               "request_id") from None
        except ValueError as error:
            raise InvalidRequest("request_id", str(error)) from None
        token = request_id_var.set(scope.request_id)
        state = common_pb2.REQUEST_STATE_FAILED
        try:
            yield scope
            state = common_pb2.REQUEST_STATE_SUCCEEDED
        except RequestCancelled as cancelled:
            raise GatewayError(grpc.StatusCode.CANCELLED,
                               f"request {scope.request_id} was cancelled "
                               f"(stage {cancelled.outcome.stage or 'none'})") from None
        except DeadlineExceeded as error:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, str(error)) from None
        except StageCallError as failed:
            raise stage_error(recipe, failed) from None
        finally:
            scope.settle(state)
            self.scopes.close(scope)
            request_id_var.reset(token)


def remote_outcome(request_id: str, mesh: Mesh, replies: list[StageCancel]
                   ) -> CancelOutcome | None:
    """What a cancel fanned out to the replicas did: the replica that stopped the request
    (the earliest stage of the recipes, if several did), else one where it had just ended;
    None if no replica held it."""
    order = {e.name: i for i, (_, e) in enumerate(mesh.endpoints())}
    held = sorted((r for r in replies if r.reply.outcome != CANCEL_PENDING),
                  key=lambda r: (r.reply.outcome != CANCEL_STOPPED, order.get(r.stage, 0)))
    if not held:
        return None
    reply = held[0].reply
    return CancelOutcome(request_id=request_id, state=reply.state, stage=held[0].stage,
                         step_index=reply.step_index,
                         abort_latency_seconds=reply.abort_latency_seconds)


def stage_error(recipe: Recipe, failed: StageCallError) -> GatewayError:
    """A failed stage call, as the client sees it (a stage that is down is named, and the
    replica when the stage has several)."""
    error = failed.error
    endpoint = recipe.stages.get(failed.stage)
    address = failed.replica or (endpoint.address if endpoint else "")
    where = f"{failed.stage} stage at {address}" if address else failed.stage
    if error.code is grpc.StatusCode.UNAVAILABLE:
        return StageUnavailable(f"{where} is unavailable: {error.message}", error.reason)
    if error.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(error.code, f"deadline exceeded in the {where}",
                            reason=error.reason)
    return GatewayError.from_stage(error)
