"""The two hooks around a call, written once: an ASGI middleware that sees HTTP requests only,
and a gRPC server interceptor that sees each call's handler once grpc has found it.

The gateway's middlewares (request ids, auth, admission, metrics, tracing) and the server
interceptors (API keys, mesh token, decode errors, tracing) subclass these and write only
what they do to a request.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")


class HttpMiddleware(abc.ABC):
    """An ASGI middleware for HTTP requests: other scopes (lifespan, websocket) pass through
    untouched, the HTTP ones go to `handle`, which calls `self.app` when it lets one on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    @abc.abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request."""


class HandlerInterceptor(grpc.aio.ServerInterceptor, abc.ABC):
    """A grpc.aio server interceptor that hands `intercept` the method's handler (None for an
    unknown method) and serves what it returns: the same handler, a wrapped one, or a
    refusal."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails],
                               Awaitable[grpc.RpcMethodHandler[RequestT, ResponseT] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[RequestT, ResponseT] | None:
        return self.intercept(await continuation(handler_call_details), handler_call_details)

    @abc.abstractmethod
    def intercept(self, handler: grpc.RpcMethodHandler[RequestT, ResponseT] | None,
                  details: grpc.HandlerCallDetails,
                  ) -> grpc.RpcMethodHandler[RequestT, ResponseT] | None:
        """The handler to serve this call with."""
