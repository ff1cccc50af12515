"""Running one stage process: engines + gRPC server + /metrics, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc
from prometheus_client import start_http_server

from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.server import RunningServer, start_server, wait_for_shutdown_signal

if TYPE_CHECKING:  # torch stays out of processes that only import the runtime's constants
    from stagemesh.shared.devices import Placement

log = logging.getLogger(__name__)

#: Running RPCs get this long to finish after a shutdown signal; then they are aborted.
SHUTDOWN_GRACE_S = 5.0


class StageEngine(Protocol):
    """What running and describing a stage needs from each of its engines (a StepEngine)."""

    @property
    def max_pending(self) -> int: ...

    @property
    def max_running(self) -> int: ...

    def start(self) -> None: ...

    def shutdown(self, abort_running: bool = True, timeout: float | None = 5.0) -> bool: ...


def stage_description(
    stage: str, model_dir: Path, engine: StageEngine, placement: Placement
) -> common_pb2.StageDescription:
    """The part of every Describe response that is the same for all stages: its model, its
    capacity and where it computes."""
    return common_pb2.StageDescription(
        stage=stage, model=str(model_dir), max_pending=engine.max_pending,
        max_running=engine.max_running, device=placement.device_name,
        dtype=placement.dtype_name)


@dataclass
class StageBundle:
    """What a stage module builds from a model folder: its engines and its gRPC servicers."""

    name: str
    engines: list[StageEngine]
    register: Callable[[grpc.aio.Server], None]
    service_names: list[str]
    info: dict[str, str] = field(default_factory=dict)  # facts for logs (model, mode)


async def start_stage(bundle: StageBundle, *, host: str = "127.0.0.1",
                      port: int = 0) -> RunningServer:
    """Start the engines and the gRPC server (port 0 = any free port)."""
    for engine in bundle.engines:
        engine.start()
    return await start_server(bundle.register, bundle.service_names, host=host, port=port)


async def stop_stage(bundle: StageBundle, server: RunningServer,
                     grace: float = SHUTDOWN_GRACE_S) -> None:
    """NOT_SERVING, let running RPCs finish within `grace`, then stop the engines."""
    await server.stop(grace)
    loop = asyncio.get_running_loop()
    for engine in bundle.engines:
        await loop.run_in_executor(None, engine.shutdown, True, grace)


async def serve_stage(bundle: StageBundle, *, host: str, port: int,
                      metrics_port: int | None) -> None:
    """Serve until SIGINT/SIGTERM (the `stagemesh stage` entry point)."""
    if metrics_port:
        start_http_server(metrics_port, addr=host)
    server = await start_stage(bundle, host=host, port=port)
    log.info("stage %s ready on %s:%d (metrics %s) %s", bundle.name, host, server.port,
             metrics_port or "off", bundle.info)
    await wait_for_shutdown_signal()
    log.info("stage %s shutting down", bundle.name)
    await stop_stage(bundle, server)
