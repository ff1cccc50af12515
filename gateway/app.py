"""The gateway process: the REST app (OpenAI routes + native routes) and the public gRPC API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagemesh.gateway.grpc_api import GatewayServicer
from stagemesh.gateway.mesh import Mesh
from stagemesh.gateway.metrics import RequestMetricsMiddleware, metrics_endpoint
from stagemesh.gateway.openai_api import OpenAIRoutes
from stagemesh.gateway.recipes import Recipe
from stagemesh.gateway.transcoding import annotated_routes
from stagemesh.shared.proto.v1 import gateway_service_pb2, gateway_service_pb2_grpc
from stagemesh.shared.server import CHANNEL_OPTIONS, RunningServer, start_server

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
GATEWAY_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


class RequestIdMiddleware:
    """Every response carries x-request-id: the client's own (if valid) or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _VALID_REQUEST_ID.match(given) else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"],
                                      (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_rest_app(mesh: Mesh, grpc_target: str) -> Starlette:
    """Starlette app: OpenAI routes + routes derived from the proto's http annotations."""
    loopback: dict[str, grpc.aio.Channel] = {}

    def channel() -> grpc.aio.Channel:
        if "channel" not in loopback:
            loopback["channel"] = grpc.aio.insecure_channel(grpc_target, options=CHANNEL_OPTIONS)
        return loopback["channel"]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if "channel" in loopback:
            await loopback["channel"].close()

    app = Starlette(routes=[*OpenAIRoutes(mesh).routes(), *annotated_routes(channel),
                            Route("/metrics", metrics_endpoint, methods=["GET"])],
                    lifespan=lifespan)
    app.add_middleware(RequestMetricsMiddleware)
    app.add_middleware(RequestIdMiddleware)
    return app


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051


async def run_gateway(recipes: dict[str, Recipe], config: GatewayConfig,
                      ready: asyncio.Event | None = None,
                      stop: asyncio.Event | None = None) -> None:
    """Serve REST and gRPC until `stop` is set (or the task is cancelled)."""
    mesh = Mesh(recipes)
    await mesh.start()
    grpc_server: RunningServer = await start_server(
        lambda server: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(
            GatewayServicer(mesh), server),
        [GATEWAY_SERVICE], host=config.host, port=config.grpc_port)
    app = build_rest_app(mesh, f"{config.host}:{grpc_server.port}")
    http = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.http_port,
                                         log_level="warning", lifespan="on",
                                         timeout_graceful_shutdown=5))
    http_task = asyncio.create_task(http.serve())
    try:
        while not http.started:
            if http_task.done():
                await http_task  # surfaces a bind error
                raise OSError(f"HTTP server on port {config.http_port} did not start")
            await asyncio.sleep(0.05)
        log.info("gateway: REST on http://%s:%d, gRPC on %s:%d", config.host, config.http_port,
                 config.host, grpc_server.port)
        if ready is not None:
            ready.set()
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        http.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(http_task, 10)
        await grpc_server.stop(grace=5)
        await mesh.close()
