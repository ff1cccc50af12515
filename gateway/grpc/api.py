"""The public gRPC API (stagemesh.v1.GatewayService): a thin adapter over NativeApi.

It turns the gRPC context into a RequestContext (the client's deadline is the request's time
budget, its API key the request's owner) and a GatewayError into a rich status (ErrorInfo +
BadRequest naming the field). Keys are checked before the handler by auth.ApiKeyInterceptor.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Never, TypeVar

import grpc

from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.errors import GatewayError, PermissionDenied
from stagemesh.gateway.grpc.native import NativeApi
from stagemesh.gateway.request_ids import check_request_id
from stagemesh.gateway.wire.admission import Admission
from stagemesh.gateway.wire.auth import ADMIN_KEYS_ENV, AUTHORIZATION, ApiKeys, metadata_value
from stagemesh.gateway.wire.requests import REQUEST_ID_HEADER
from stagemesh.shared.errors import build_status
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
Context = grpc.aio.ServicerContext[object, object]
#: The metadata keys of a request's id and of a 429's retry delay (seconds), as in REST.
REQUEST_ID_METADATA = REQUEST_ID_HEADER
RETRY_AFTER_METADATA = "retry-after"


async def _abort(context: Context, error: GatewayError, admission: Admission) -> Never:
    """End the call with `error` as a rich status; a RESOURCE_EXHAUSTED also carries
    `retry-after` (seconds) in its trailing metadata, as a REST 429 carries Retry-After."""
    status = build_status(error.code, error.message, reason=error.reason,
                          field_name=error.field_name)
    trailing = tuple(status.trailing_metadata)
    if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        seconds = admission.retry_after() if error.retry_after is None else error.retry_after
        trailing += ((RETRY_AFTER_METADATA, str(seconds)),)
    await context.abort(status.code, status.details, trailing)


def _request_context(context: Context, keys: ApiKeys, timeout: float | None) -> RequestContext:
    """The caller's owner (its API key), its `x-request-id` metadata (a request message's
    own request_id wins) and its time budget."""
    metadata = context.invocation_metadata()
    request_id = check_request_id(metadata_value(metadata, REQUEST_ID_METADATA) or "",
                                  REQUEST_ID_METADATA)
    return RequestContext.create(request_id, timeout,
                                 keys.owner(metadata_value(metadata, AUTHORIZATION)))


#: A streaming RPC's body: NativeApi's call for the request in its RequestContext.
StreamCall = Callable[["GatewayServicer", RequestT, RequestContext],
                      AsyncGenerator[ResponseT, None]]
#: ... as grpc.aio serves it: an async generator function of the gRPC call.
StreamRpc = Callable[["GatewayServicer", RequestT, Context], AsyncGenerator[ResponseT, None]]


def streaming_rpc(*, admitted: bool = True
                  ) -> Callable[[StreamCall[RequestT, ResponseT]], StreamRpc[RequestT, ResponseT]]:
    """One server-streaming RPC, written once for all: the call's budget is its deadline, a
    GatewayError ends it with a rich status, and the stream behind it is closed as soon as
    the client goes. An `admitted` one starts a request and holds an admission slot for its
    whole life; a stream that only reads what a background job does (watch, download) starts
    no work, so it takes none, and lives until the client's deadline."""
    def wrap(call: StreamCall[RequestT, ResponseT]) -> StreamRpc[RequestT, ResponseT]:
        @functools.wraps(call)
        async def rpc(servicer: GatewayServicer, request: RequestT, context: Context
                      ) -> AsyncGenerator[ResponseT, None]:
            try:
                with servicer.admission.slot() if admitted else contextlib.nullcontext():
                    request_context = _request_context(context, servicer.keys,
                                                       context.time_remaining())
                    async with contextlib.aclosing(
                            call(servicer, request, request_context)) as responses:
                        async for response in responses:
                            yield response
            except GatewayError as error:
                await _abort(context, error, servicer.admission)

        return rpc

    return wrap


class GatewayServicer(gateway_service_pb2_grpc.GatewayServiceServicer):
    """Each RPC on NativeApi. A streaming RPC that starts a request holds an admission slot
    for its whole life (streaming_rpc); unary RPCs (cancel, lists, video jobs, whose work runs
    in the background) and the streams that follow a job start none."""

    def __init__(self, api: NativeApi, keys: ApiKeys | None = None,
                 admission: Admission | None = None) -> None:
        self.api = api
        self.keys = ApiKeys() if keys is None else keys
        self.admission = Admission(None) if admission is None else admission

    @streaming_rpc()
    def GenerateImage(self, request: pb.GenerateImageRequest, context: RequestContext
                      ) -> AsyncGenerator[pb.GenerateImageResponse, None]:
        return self.api.GenerateImage(request, context)

    @streaming_rpc()
    def EditImage(self, request: pb.EditImageRequest, context: RequestContext
                  ) -> AsyncGenerator[pb.GenerateImageResponse, None]:
        return self.api.EditImage(request, context)

    @streaming_rpc()
    def SynthesizeSpeech(self, request: pb.SynthesizeSpeechRequest, context: RequestContext
                         ) -> AsyncGenerator[pb.SynthesizeSpeechResponse, None]:
        return self.api.SynthesizeSpeech(request, context)

    @streaming_rpc()
    def TranscribeAudio(self, request: pb.TranscribeAudioRequest, context: RequestContext
                        ) -> AsyncGenerator[pb.TranscribeAudioResponse, None]:
        return self.api.TranscribeAudio(request, context)

    @streaming_rpc()
    def Chat(self, request: pb.ChatRequest, context: RequestContext
             ) -> AsyncGenerator[pb.ChatResponse, None]:
        return self.api.Chat(request, context)

    @streaming_rpc(admitted=False)
    def WatchVideo(self, request: pb.WatchVideoRequest, context: RequestContext
                   ) -> AsyncGenerator[pb.VideoJob, None]:
        return self.api.WatchVideo(request, context)

    @streaming_rpc(admitted=False)
    def DownloadVideo(self, request: pb.DownloadVideoRequest, context: RequestContext
                      ) -> AsyncGenerator[pb.DownloadVideoResponse, None]:
        return self.api.DownloadVideo(request, context)

    async def _unary(self, call: Callable[[RequestT, RequestContext], Awaitable[ResponseT]],
                     request: RequestT, context: Context) -> ResponseT:
        """Cancel and list calls need no time budget of their own."""
        try:
            return await call(request, _request_context(context, self.keys, None))
        except GatewayError as error:
            await _abort(context, error, self.admission)

    async def _admin(self, call: Callable[[RequestT, RequestContext], Awaitable[ResponseT]],
                     request: RequestT, context: Context) -> ResponseT:
        """An RPC that changes what the mesh serves: admin keys only, as REST's ADMIN_PATHS."""
        async def checked(request: RequestT, request_context: RequestContext) -> ResponseT:
            caller = self.keys.caller(metadata_value(context.invocation_metadata(),
                                                     AUTHORIZATION))
            if not caller.admin:
                raise PermissionDenied(f"{call.__name__} needs an admin key ({ADMIN_KEYS_ENV})")
            return await call(request, request_context)

        return await self._unary(checked, request, context)

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Context
                       ) -> pb.LoadLoraResponse:
        return await self._admin(self.api.LoadLora, request, context)

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: Context
                         ) -> pb.UnloadLoraResponse:
        return await self._admin(self.api.UnloadLora, request, context)

    async def ListLoras(self, request: pb.ListLorasRequest, context: Context
                        ) -> pb.ListLorasResponse:
        return await self._unary(self.api.ListLoras, request, context)

    async def CancelRequest(
        self, request: pb.CancelRequestRequest, context: Context,
    ) -> pb.CancelRequestResponse:
        return await self._unary(self.api.CancelRequest, request, context)

    async def ListStages(
        self, request: pb.ListStagesRequest, context: Context,
    ) -> pb.ListStagesResponse:
        return await self._unary(self.api.ListStages, request, context)

    async def ListRecipes(
        self, request: pb.ListRecipesRequest, context: Context,
    ) -> pb.ListRecipesResponse:
        return await self._unary(self.api.ListRecipes, request, context)

    async def CreateVideo(self, request: pb.CreateVideoRequest,
                          context: Context) -> pb.VideoJob:
        """Returns at once: the job runs in the background (its own slots, videos/jobs.py)."""
        return await self._unary(self.api.CreateVideo, request, context)

    async def GetVideo(self, request: pb.GetVideoRequest, context: Context) -> pb.VideoJob:
        return await self._unary(self.api.GetVideo, request, context)

    async def ListVideos(self, request: pb.ListVideosRequest,
                         context: Context) -> pb.ListVideosResponse:
        return await self._unary(self.api.ListVideos, request, context)

    async def DeleteVideo(self, request: pb.DeleteVideoRequest,
                          context: Context) -> pb.VideoJob:
        return await self._unary(self.api.DeleteVideo, request, context)
