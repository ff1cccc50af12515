"""The mesh credential: a shared token that gateway -> stage calls carry and stages check.

A stage serves only the mesh. Every call to it must carry the token in the
`x-stagemesh-mesh-token` metadata, except the gRPC health checks (the kubelet's probes carry no
metadata) and server reflection (it serves only the schema, which is public in protos/, and
keeps grpcurl and reflection-based clients working; every call they then make needs the
token). The token comes from
`STAGEMESH_MESH_TOKEN`, or from the file `STAGEMESH_MESH_TOKEN_FILE` names (a mounted Secret);
`stagemesh serve` makes a random one for its own stages when neither is set
(`ensure_mesh_token`). With no token configured the check is off, as it is for a stage run by
hand on loopback.

The client half is a channel interceptor (`client_interceptors`, used by
`shared.server.open_channel`): insecure channels cannot carry CallCredentials, and metadata
added per call by an interceptor needs no change where calls are made. The server half is a
server interceptor (`server_interceptors`, used by the stage runtime) that answers
UNAUTHENTICATED without deserializing the request (a streamed one is read and dropped first, so
that the refusal does not race the caller's write; see `_refuse_stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    MutableMapping,
)
from pathlib import Path
from typing import TypeVar

import grpc
from grpc.aio import ClientCallDetails, Metadata

from stagemesh.shared.interception import HandlerInterceptor

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")

TOKEN_ENV = "STAGEMESH_MESH_TOKEN"
TOKEN_FILE_ENV = "STAGEMESH_MESH_TOKEN_FILE"
#: The metadata key a mesh call carries its token in (lower case, as gRPC requires).
METADATA_KEY = "x-stagemesh-mesh-token"
#: gRPC's own services, which every caller may reach and nothing traces: health (the kubelet's
#: probes, `serve`'s wait) and reflection (the public schema only). The one list the mesh
#: token, the gateway's API keys and the server spans all consult.
INFRASTRUCTURE_SERVICES = frozenset({"grpc.health.v1.Health",
                                     "grpc.reflection.v1alpha.ServerReflection",
                                     "grpc.reflection.v1.ServerReflection"})


def is_infrastructure(method: str) -> bool:
    """Whether '/pkg.Service/Method' belongs to one of INFRASTRUCTURE_SERVICES."""
    return method.lstrip("/").split("/", 1)[0] in INFRASTRUCTURE_SERVICES
#: Shortest token accepted: a guessable token is no credential.
MIN_TOKEN_CHARS = 16
#: The longest a refused stream is read (and dropped) before its refusal is sent: a caller
#: that sends one message and half-closes is done in milliseconds, one that keeps its stream
#: open (waiting for an answer before it writes more) gets the refusal after this.
REFUSAL_DRAIN_S = 1.0


class MeshTokenError(ValueError):
    """The configured mesh token is unusable (empty, too short, unreadable, not metadata-safe)."""


def _checked(token: str, source: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise MeshTokenError(f"the mesh token from {source} must be at least "
                             f"{MIN_TOKEN_CHARS} characters")
    if not all(33 <= ord(char) <= 126 for char in token):  # gRPC metadata: visible ASCII
        raise MeshTokenError(f"the mesh token from {source} must be visible ASCII characters")
    return token


def mesh_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The configured token (env first, then the file), or None when the check is off.

    Read at start-up and when a channel opens, so a bad configuration fails loudly there.
    """
    env = os.environ if environ is None else environ
    if value := env.get(TOKEN_ENV):
        return _checked(value, TOKEN_ENV)
    if path := env.get(TOKEN_FILE_ENV):
        try:
            text = Path(path).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as error:
            raise MeshTokenError(f"cannot read the mesh token file {path}: {error}") from None
        return _checked(text, path)
    return None


def ensure_mesh_token(environ: MutableMapping[str, str] | None = None) -> str:
    """The configured token, or a new random one set in `environ` (default os.environ) so that
    the processes started from it (stages, gateway) share it. Used by `stagemesh serve`."""
    env = os.environ if environ is None else environ
    token = mesh_token(env)
    if token is None:
        token = secrets.token_urlsafe(32)
        env[TOKEN_ENV] = token
        log.info("mesh credential: a new random token for this mesh's stages")
    return token


# -- client side ------------------------------------------------------------------------------


def _with_token(details: ClientCallDetails, token: str) -> ClientCallDetails:
    metadata = Metadata(*(details.metadata or ()))
    metadata[METADATA_KEY] = token
    return ClientCallDetails(method=details.method, timeout=details.timeout, metadata=metadata,
                             credentials=details.credentials,
                             wait_for_ready=details.wait_for_ready)


class _AddToken:
    """Adds the token to a channel's calls. A channel files each interceptor under the first
    call kind it implements, so one subclass per kind (below) shares these methods."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(
        self,
        continuation: Callable[[ClientCallDetails, RequestT],
                               Awaitable[grpc.aio.UnaryUnaryCall[RequestT, ResponseT]]],
        client_call_details: ClientCallDetails,
        request: RequestT,
    ) -> ResponseT | grpc.aio.UnaryUnaryCall[RequestT, ResponseT]:
        return await continuation(_with_token(client_call_details, self._token), request)

    async def intercept_unary_stream(
        self,
        continuation: Callable[[ClientCallDetails, RequestT],
                               Awaitable[grpc.aio.UnaryStreamCall[RequestT, ResponseT]]],
        client_call_details: ClientCallDetails,
        request: RequestT,
    ) -> AsyncIterator[ResponseT] | grpc.aio.UnaryStreamCall[RequestT, ResponseT]:
        return await continuation(_with_token(client_call_details, self._token), request)

    async def intercept_stream_unary(
        self,
        continuation: Callable[[ClientCallDetails, AsyncIterable[RequestT] | Iterable[RequestT]],
                               Awaitable[grpc.aio.StreamUnaryCall[RequestT, ResponseT]]],
        client_call_details: ClientCallDetails,
        request_iterator: AsyncIterable[RequestT] | Iterable[RequestT],
    ) -> ResponseT | grpc.aio.StreamUnaryCall[RequestT, ResponseT]:
        return await continuation(_with_token(client_call_details, self._token),
                                  request_iterator)

    async def intercept_stream_stream(
        self,
        continuation: Callable[[ClientCallDetails, AsyncIterable[RequestT] | Iterable[RequestT]],
                               Awaitable[grpc.aio.StreamStreamCall[RequestT, ResponseT]]],
        client_call_details: ClientCallDetails,
        request_iterator: AsyncIterable[RequestT] | Iterable[RequestT],
    ) -> AsyncIterator[ResponseT] | grpc.aio.StreamStreamCall[RequestT, ResponseT]:
        return await continuation(_with_token(client_call_details, self._token),
                                  request_iterator)


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    pass


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    pass


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    pass


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    pass


def client_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `token` to every call of a channel (none when token is None)."""
    if token is None:
        return []
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


# -- server side ------------------------------------------------------------------------------


async def _refuse_unary(request: object, context: grpc.aio.ServicerContext[object, object]
                        ) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this stage serves the mesh only: "
                        f"the call carries no valid {METADATA_KEY}")


async def _refuse_stream(request_iterator: AsyncIterable[object],
                         context: grpc.aio.ServicerContext[object, object]) -> None:
    # Read what the caller is still writing (raw bytes, dropped: no deserializer) before the
    # refusal: a status that ends the call while a large message is still being sent races
    # that send, and grpc's aio client then reports INTERNAL instead of the status. gRPC
    # still bounds each message (RESOURCE_EXHAUSTED) and REFUSAL_DRAIN_S bounds the wait.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(REFUSAL_DRAIN_S):
            async for _ in request_iterator:
                pass
    await _refuse_unary(None, context)


def _refusal(
    handler: grpc.RpcMethodHandler[RequestT, ResponseT] | None,
) -> grpc.RpcMethodHandler[RequestT, ResponseT]:
    """A handler of `handler`'s kind that refuses the call without reading it (no
    deserializer: an unauthenticated message is never parsed). An unknown method is refused
    the same way, so a caller without the token learns nothing about what the stage serves."""
    if handler is None or (handler.request_streaming and handler.response_streaming):
        return grpc.stream_stream_rpc_method_handler(_refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse_stream)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse_unary)
    return grpc.unary_unary_rpc_method_handler(_refuse_unary)


class MeshTokenInterceptor(HandlerInterceptor):
    """Refuses UNAUTHENTICATED every call without the mesh token, except the health checks."""

    def __init__(self, token: str) -> None:
        self._token = token.encode("ascii")

    def is_authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if is_infrastructure(details.method):
            return True
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == METADATA_KEY:
                given = value.encode("utf-8", "replace") if isinstance(value, str) else value
        return hmac.compare_digest(given, self._token)  # constant time in the token's length

    def intercept(self, handler: grpc.RpcMethodHandler[RequestT, ResponseT] | None,
                  handler_call_details: grpc.HandlerCallDetails,
                  ) -> grpc.RpcMethodHandler[RequestT, ResponseT] | None:
        if self.is_authorized(handler_call_details):
            return handler
        log.warning("refused %s: no valid mesh token", handler_call_details.method)
        return _refusal(handler)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    """The stage server's interceptors for `token` (none when the check is off)."""
    return [] if token is None else [MeshTokenInterceptor(token)]
