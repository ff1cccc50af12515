"""The gateway process: the REST app (http/) and the public gRPC API (grpc/) over one
GatewayCore.

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
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.grpc.api import GatewayServicer
from stagemesh.gateway.grpc.decode import DecodeErrorInterceptor
from stagemesh.gateway.grpc.native import NativeApi
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.mesh.stages import Mesh, StageCatalog
from stagemesh.gateway.realtime.protocol import WS_MAX_BYTES, RealtimeLimits
from stagemesh.gateway.recipes import Recipe
from stagemesh.gateway.videos.jobs import video_jobs
from stagemesh.gateway.wire.admission import Admission
from stagemesh.gateway.wire.auth import ApiKeyInterceptor, ApiKeys
from stagemesh.gateway.wire.requests import MAX_BODY_BYTES
from stagemesh.shared.proto.v1 import gateway_service_pb2, gateway_service_pb2_grpc
from stagemesh.shared.server import RunningServer, start_server
from stagemesh.shared.tracing import GrpcServerSpans

log = logging.getLogger(__name__)

GATEWAY_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
HTTP_STOP_TIMEOUT_S = 10.0
GRPC_STOP_GRACE_S = 5.0
#: Room for a request's text fields next to its largest binary field.
TEXT_FIELDS_BYTES = 1024 * 1024
#: The largest message the public gRPC port accepts: the largest legal request, a reference
#: clip as large as a REST body can carry it (base64: 3 bytes per 4 characters), plus text.
MAX_GRPC_REQUEST_BYTES = MAX_BODY_BYTES * 3 // 4 + TEXT_FIELDS_BYTES


@contextlib.asynccontextmanager
async def open_gateway(recipes: Mapping[str, Recipe]) -> AsyncIterator[GatewayCore]:
    """Channels and the stage catalog for `recipes`, open for the life of the block."""
    mesh = Mesh(recipes)
    await mesh.start()
    catalog = StageCatalog(mesh)
    catalog.start()
    core = GatewayCore(mesh, catalog)
    video_jobs(core)  # from the start, a cancel by id reaches jobs other gateways run
    try:
        yield core
    finally:
        await core.close()  # video jobs still running end as failed ("the gateway stopped")
        await catalog.close()
        await mesh.close()


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    #: A file of API keys (one a line, `#` comments), read with STAGEMESH_API_KEYS.
    api_keys_file: Path | None = None
    #: Requests running at once before 429; None = sized from the stages' queues.
    max_concurrent_requests: int | None = None
    #: GET /v1/realtime's sessions, idle timeout and buffer.
    realtime: RealtimeLimits = field(default_factory=RealtimeLimits)


async def _serve_http(app: Starlette, config: GatewayConfig) -> tuple[uvicorn.Server,
                                                                      asyncio.Task[None]]:
    """Start uvicorn and wait until it listens (a bind error surfaces here)."""
    http = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.http_port,
                                         log_level="warning", lifespan="on",
                                         ws_max_size=WS_MAX_BYTES,
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
            http, http_task = await _serve_http(build_rest_app(core, keys, admission,
                                                           config.realtime), config)
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
