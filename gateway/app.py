"""The gateway process: the REST app and the public gRPC API over one GatewayCore.

`open_gateway` is the application's lifespan: it opens one channel per stage address and
starts watching them (the stage catalog), and closes both on the way out. REST and gRPC then
call the same in-process core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagemesh.gateway.cancel import new_request_id
from stagemesh.gateway.catalog import StageCatalog
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.grpc_api import GatewayServicer
from stagemesh.gateway.http_io import REQUEST_ID_HEADER
from stagemesh.gateway.mesh import Mesh
from stagemesh.gateway.metrics import RequestMetricsMiddleware
from stagemesh.gateway.native import NativeApi
from stagemesh.gateway.recipes import Recipe
from stagemesh.gateway.routes import rest_routes
from stagemesh.shared.limits import MAX_REQUEST_ID_CHARS
from stagemesh.shared.proto.v1 import gateway_service_pb2, gateway_service_pb2_grpc
from stagemesh.shared.server import RunningServer, start_server

log = logging.getLogger(__name__)

#: A client's x-request-id is kept when it is short and safe to echo in a header.
_VALID_REQUEST_ID = re.compile(rf"^[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}$")
GATEWAY_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
HTTP_STOP_TIMEOUT_S = 10.0
GRPC_STOP_GRACE_S = 5.0


class RequestIdMiddleware:
    """Every response carries x-request-id: the client's own (if valid) or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _VALID_REQUEST_ID.match(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


@contextlib.asynccontextmanager
async def open_gateway(recipes: Mapping[str, Recipe]) -> AsyncIterator[GatewayCore]:
    """Channels and the stage catalog for `recipes`, open for the life of the block."""
    mesh = Mesh(recipes)
    await mesh.start()
    catalog = StageCatalog(mesh)
    catalog.start()
    try:
        yield GatewayCore(mesh, catalog)
    finally:
        await catalog.close()
        await mesh.close()


def build_rest_app(core: GatewayCore) -> Starlette:
    """The REST app over an open core (see routes.py for the routes)."""
    app = Starlette(routes=rest_routes(core))
    app.add_middleware(RequestMetricsMiddleware)
    app.add_middleware(RequestIdMiddleware)
    return app


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051


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
    async with open_gateway(recipes) as core:
        api = NativeApi(core)
        grpc_server: RunningServer = await start_server(
            lambda server: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(
                GatewayServicer(api), server),
            [GATEWAY_SERVICE], host=config.host, port=config.grpc_port)
        http: uvicorn.Server | None = None
        http_task: asyncio.Task[None] | None = None
        try:
            http, http_task = await _serve_http(build_rest_app(core), config)
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
