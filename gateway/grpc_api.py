"""The public gRPC API (stagemesh.v1.GatewayService): a thin adapter over NativeApi.

It turns the gRPC context into a RequestContext (the client's deadline is the request's time
budget) and a GatewayError into a rich status (ErrorInfo + BadRequest naming the field).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Never, TypeVar

import grpc

from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.native import NativeApi
from stagemesh.shared.errors import build_status
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
Context = grpc.aio.ServicerContext[object, object]


async def _abort(context: Context, error: GatewayError) -> Never:
    await context.abort_with_status(build_status(error.code, error.message, reason=error.reason,
                                                 field_name=error.field_name))


def _request_context(context: Context) -> RequestContext:
    """A gRPC call's budget is its deadline; its id is in the request message."""
    return RequestContext.create(None, context.time_remaining())


async def _unary(call: Callable[[RequestT, RequestContext], Awaitable[ResponseT]],
                 request: RequestT, context: Context) -> ResponseT:
    """Cancel and list calls start no request: they need no time budget of their own."""
    try:
        return await call(request, RequestContext.create(None, None))
    except GatewayError as error:
        await _abort(context, error)


async def _stream(call: Callable[[RequestT, RequestContext], AsyncGenerator[ResponseT, None]],
                  request: RequestT, context: Context) -> AsyncGenerator[ResponseT, None]:
    try:
        async with contextlib.aclosing(call(request, _request_context(context))) as responses:
            async for response in responses:
                yield response
    except GatewayError as error:
        await _abort(context, error)


class GatewayServicer(gateway_service_pb2_grpc.GatewayServiceServicer):
    def __init__(self, api: NativeApi) -> None:
        self.api = api

    async def GenerateImage(
        self, request: pb.GenerateImageRequest, context: Context,
    ) -> AsyncIterator[pb.GenerateImageResponse]:
        responses = _stream(self.api.GenerateImage, request, context)
        async with contextlib.aclosing(responses) as stream:
            async for response in stream:
                yield response

    async def SynthesizeSpeech(
        self, request: pb.SynthesizeSpeechRequest, context: Context,
    ) -> AsyncIterator[pb.SynthesizeSpeechResponse]:
        responses = _stream(self.api.SynthesizeSpeech, request, context)
        async with contextlib.aclosing(responses) as stream:
            async for response in stream:
                yield response

    async def CancelRequest(
        self, request: pb.CancelRequestRequest, context: Context,
    ) -> pb.CancelRequestResponse:
        return await _unary(self.api.CancelRequest, request, context)

    async def ListStages(
        self, request: pb.ListStagesRequest, context: Context,
    ) -> pb.ListStagesResponse:
        return await _unary(self.api.ListStages, request, context)

    async def ListRecipes(
        self, request: pb.ListRecipesRequest, context: Context,
    ) -> pb.ListRecipesResponse:
        return await _unary(self.api.ListRecipes, request, context)
