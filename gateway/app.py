"""The gateway process: the REST app and the public gRPC API over one GatewayCore.

`open_gateway` is the application's lifespan: it opens one channel per stage address and
starts watching them (the stage catalog), and closes both on the way out. REST and gRPC then
call the same in-process core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.grpc.api import GatewayServicer
from stagemesh.gateway.grpc.decode import DecodeErrorInterceptor
from stagemesh.gateway.grpc.native import NativeApi
from stagemesh.gateway.http.admission import Admission, AdmissionMiddleware
from stagemesh.gateway.http.auth import ApiKeyInterceptor, ApiKeyMiddleware, ApiKeys, header
from stagemesh.gateway.http.metrics import RequestMetricsMiddleware
from stagemesh.gateway.http.routes import rest_routes
from stagemesh.gateway.mesh.cancel import new_request_id
from stagemesh.gateway.mesh.catalog import StageCatalog
from stagemesh.gateway.mesh.channels import Mesh
from stagemesh.gateway.recipes import Recipe
from stagemesh.gateway.request_ids import check_request_id
from stagemesh.gateway.wire.bodies import MAX_BODY_BYTES, REQUEST_ID_HEADER, error_response
from stagemesh.shared.proto.v1 import gateway_service_pb2, gateway_service_pb2_grpc
from stagemesh.shared.server import RunningServer, start_server
from stagemesh.shared.tracing import GrpcServerSpans, TracingMiddleware

log = logging.getLogger(__name__)

GATEWAY_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
HTTP_STOP_TIMEOUT_S = 10.0
GRPC_STOP_GRACE_S = 5.0
#: Room for a request's text fields next to its largest binary field.
TEXT_FIELDS_BYTES = 1024 * 1024
#: The largest message the public gRPC port accepts: the largest legal request, a reference
#: clip as large as a REST body can carry it (base64: 3 bytes per 4 characters), plus text.
MAX_GRPC_REQUEST_BYTES = MAX_BODY_BYTES * 3 // 4 + TEXT_FIELDS_BYTES


class RequestIdMiddleware:
    """Every response carries x-request-id: the client's own, or a new one when it sent none.
    An x-request-id the client did send that breaks the rule (request_ids.py) is a 400
    naming `x-request-id`: never replaced, so the client can cancel by its own id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = header(scope, REQUEST_ID_HEADER.encode()) or ""
        try:
            request_id = check_request_id(given, REQUEST_ID_HEADER) or new_request_id()
        except InvalidRequest as error:
            await error_response(error)(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                # a route may name the request itself (a video job's id) when the client
                # gave no id
                final = state.get("request_id", request_id)
                message["headers"] = [*message.get("headers", []),
                                      (REQUEST_ID_HEADER.encode(), str(final).encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


@contextlib.asynccontextmanager
async def open_gateway(recipes: Mapping[str, Recipe]) -> AsyncIterator[GatewayCore]:
    """Channels and the stage catalog for `recipes`, open for the life of the block."""
    mesh = Mesh(recipes)
    await mesh.start()
    catalog = StageCatalog(mesh)
    catalog.start()
    core = GatewayCore(mesh, catalog)
    try:
        yield core
    finally:
        await core.videos.close()  # jobs still running end as failed ("the gateway stopped")
        await catalog.close()
        await mesh.close()


def build_rest_app(core: GatewayCore, keys: ApiKeys | None = None,
                   admission: Admission | None = None) -> Starlette:
    """The REST app over an open core (see routes.py for the routes). Outermost first: the
    request id (every answer carries one), metrics (refusals are counted), API keys, then
    admission (a refused caller takes no slot)."""
    keys = ApiKeys() if keys is None else keys
    admission = Admission(core) if admission is None else admission
    app = Starlette(routes=rest_routes(core))
    app.add_middleware(AdmissionMiddleware, admission=admission)
    app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(RequestMetricsMiddleware)
    app.add_middleware(TracingMiddleware)  # a server span per request, when traces are on
    app.add_middleware(RequestIdMiddleware)
    return app


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    #: A file of API keys (one a line, `#` comments), read with STAGEMESH_API_KEYS.
    api_keys_file: Path | None = None
    #: Requests running at once before 429; None = sized from the stages' queues.
    max_concurrent_requests: int | None = None


async def _serve_http(app: Starlette, config: GatewayConfig) -> tuple[uvicorn.Server,
                                                                      asyncio.Task[None]]:
    """Start uvicorn and wait until it listens (a bind error surfaces here)."""
    http = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.http_port,
                                         log_level="warning", lifespan="on",
                                         timeout_graceful_shutdown=5))
    task = asyncio.create_task(http.serve())
    while not http.started:
        if task.done():
            await task
            raise OSError(f"HTTP server on port {config.http_port} did not start")
        await asyncio.sleep(0.05)
    return http, task


async def run_gateway(recipes: dict[str, Recipe], config: GatewayConfig,
                      ready: asyncio.Event | None = None,
                      stop: asyncio.Event | None = None) -> None:
    """Serve REST and gRPC until `stop` is set (or the task is cancelled)."""
    keys = ApiKeys.load(os.environ, config.api_keys_file)
    keys.log_mode("gateway")
    async with open_gateway(recipes) as core:
        admission = Admission(core, config.max_concurrent_requests)
        servicer = GatewayServicer(NativeApi(core), keys, admission)
        grpc_server: RunningServer = await start_server(
            lambda server: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(
                servicer, server),
            [GATEWAY_SERVICE], host=config.host, port=config.grpc_port,
            interceptors=[GrpcServerSpans(), ApiKeyInterceptor(keys), DecodeErrorInterceptor()],
            max_receive_bytes=MAX_GRPC_REQUEST_BYTES)
        http: uvicorn.Server | None = None
        http_task: asyncio.Task[None] | None = None
        try:
            http, http_task = await _serve_http(build_rest_app(core, keys, admission), config)
            log.info("gateway: REST on http://%s:%d, gRPC on %s:%d", config.host,
                     config.http_port, config.host, grpc_server.port)
            if ready is not None:
                ready.set()
            await (stop.wait() if stop is not None else asyncio.Event().wait())
        finally:
            if http is not None and http_task is not None:
                http.should_exit = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(http_task, HTTP_STOP_TIMEOUT_S)
            await grpc_server.stop(grace=GRPC_STOP_GRACE_S)
