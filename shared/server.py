"""One way to run a gRPC server: health, reflection, limits, keepalive, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stagemesh.shared.limits import MAX_STAGE_MESSAGE_BYTES
from stagemesh.shared.mesh_auth import client_interceptors, mesh_token

log = logging.getLogger(__name__)

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_STAGE_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_STAGE_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A second server on a busy port must fail to bind, not share the port with the first.
    ("grpc.so_reuseport", 0),
]

#: Client-side twin of SERVER_OPTIONS, for every channel the mesh opens.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_STAGE_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_STAGE_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def open_channel(target: str) -> grpc.aio.Channel:
    """The one way the mesh opens a channel to a stage: the options above, and the mesh token
    (`shared.mesh_auth`, read from the environment now) on every call when one is configured."""
    interceptors = client_interceptors(mesh_token())
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS,
                                     interceptors=interceptors or None)


@dataclass
class RunningServer:
    """A started server, the port it bound, and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health_async.HealthServicer
    service_names: Sequence[str]

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Report NOT_SERVING, refuse new RPCs, give running ones `grace` seconds."""
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int = MAX_STAGE_MESSAGE_BYTES,
) -> RunningServer:
    """Create, register servicers (via `register`), add health + reflection, bind, start.

    port=0 binds a free port (tests); the bound port is returned. interceptors: run on every
    call before its handler (a stage passes `mesh_auth.server_interceptors(...)`, which leaves
    the health service open). max_receive_bytes: the largest message a client may send (the
    gateway's public port sizes it to its largest legal request).
    """
    options = [*(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
               ("grpc.max_receive_message_length", max_receive_bytes)]
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    register(server)
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    running = RunningServer(server=server, port=bound, health=health, service_names=service_names)
    await running.set_serving(True)
    log.info("serving %s on %s:%d", ", ".join(service_names), host, bound)
    return running


async def wait_for_shutdown_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
