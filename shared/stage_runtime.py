"""Running one stage process: engines + gRPC server + /metrics, until SIGINT/SIGTERM.

Every stage also serves StageControlService (shared/control.py: cancel by id from any gateway,
load reports), registered here so that no servicer needs to know about it.

Drain (SIGTERM, as Kubernetes sends before it removes a pod): health turns NOT_SERVING at once
(gateways stop routing here), new starts are refused with UNAVAILABLE (a gateway retries them
on another replica), requests already admitted run to their end for up to `drain_grace_s`
(option, default 30 s), then those left are aborted with reason SHUTDOWN (a gateway reports
them UNAVAILABLE, naming the stage), the server keeps refusing starts until every stream has
ended and starts have stopped coming (a server that stops cuts both), and the process exits.
Cancel and load RPCs keep working while it drains. An engine thread that dies turns health
NOT_SERVING too, and the process exits with status 1 so that its supervisor (`stagemesh
serve`, Kubernetes) restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
from prometheus_client import start_http_server

from stagemesh.shared.control import SERVICE_NAME as CONTROL_SERVICE
from stagemesh.shared.control import ControlledEngine, StageControl, add_control
from stagemesh.shared.limits import MAX_STAGE_MESSAGE_BYTES
from stagemesh.shared.mesh_auth import mesh_token, server_interceptors
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.server import RunningServer, start_server
from stagemesh.shared.stage_stream import open_streams

if TYPE_CHECKING:  # torch stays out of processes that only import the runtime's constants
    from stagemesh.shared.devices import Placement

log = logging.getLogger(__name__)

ServicerT = TypeVar("ServicerT")

#: Running RPCs get this long to finish after a shutdown signal; then they are aborted.
SHUTDOWN_GRACE_S = 5.0
#: A draining stage lets admitted requests run this long unless its `drain_grace_s` says.
DEFAULT_DRAIN_GRACE_S = 30.0
#: After the engines stopped, open RPCs get this long to send their last event; the server
#: keeps refusing starts (UNAVAILABLE, DRAINING: a gateway retries them elsewhere) meanwhile.
FLUSH_GRACE_S = 3.0
#: The last part of FLUSH_GRACE_S, left to the server's own stop, so that the statuses of
#: streams whose handler just returned are written before it cancels what is left.
STOP_GRACE_S = 0.5
#: The server stops only once it has refused starts, and no stage stream has opened, for this
#: long: a gateway that has not yet polled the NOT_SERVING health (gateway/mesh/balancer.py polls
#: each second) gets a clean refusal, which it retries elsewhere. A stream that reaches a server
#: already stopping is cut by gRPC (CANCELLED, or UNAVAILABLE without the stage's reason).
QUIET_S = 1.0
#: How often the drain looks at the open streams.
FLUSH_POLL_S = 0.05
#: How often the runtime checks that every engine thread is alive.
ENGINE_WATCH_S = 0.5
#: The option every stage takes besides its own (read here, not by the stage's builder).
DRAIN_GRACE_OPTION = "drain_grace_s"


class StageEngine(ControlledEngine, Protocol):
    """What running and describing a stage needs from each of its engines (a StepEngine)."""

    @property
    def max_pending(self) -> int: ...

    @property
    def max_running(self) -> int: ...

    @property
    def stopped(self) -> bool: ...

    def start(self) -> None: ...

    def shutdown(self, abort_running: bool = True, timeout: float | None = 5.0) -> bool: ...


@dataclass(frozen=True)
class RuntimeOptions:
    """The options of the stage process itself (every stage takes them)."""

    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S


def split_runtime_options(
    stage: str, options: Mapping[str, object]
) -> tuple[RuntimeOptions, dict[str, object]]:
    """The runtime's options out of a stage's `options:`, and the rest for the stage's builder.
    Raises ValueError naming the stage and the option for a bad value."""
    rest = dict(options)
    grace = rest.pop(DRAIN_GRACE_OPTION, DEFAULT_DRAIN_GRACE_S)
    if isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0:
        raise ValueError(f"stage {stage}: option {DRAIN_GRACE_OPTION!r} must be a number of "
                         f"seconds >= 0, got {grace!r}")
    return RuntimeOptions(drain_grace_s=float(grace)), rest


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
    #: Largest message a client may send; a stage whose largest legal input is small (the
    #: tokenizer) sets less, so gRPC refuses a bigger one before it is parsed.
    max_receive_bytes: int = MAX_STAGE_MESSAGE_BYTES


def servicer_bundle(
    name: str,
    model_dir: Path,
    engines: Sequence[StageEngine],
    servicer: ServicerT,
    add_servicer: Callable[[ServicerT, grpc.aio.Server], None],
    service_name: str,
    info: Mapping[str, str],
    max_receive_bytes: int = MAX_STAGE_MESSAGE_BYTES,
) -> StageBundle:
    """The last step of every stage's build: its engines (the main one first), its servicer
    with the generated `add_...Servicer_to_server`, and its facts for the logs: the model and
    the main engine's capacity, then the stage's own `info`."""
    return StageBundle(
        name=name, engines=list(engines), service_names=[service_name],
        register=lambda server: add_servicer(servicer, server),
        info={"model": str(model_dir), "max_running": str(engines[0].max_running), **info},
        max_receive_bytes=max_receive_bytes)


async def start_stage(bundle: StageBundle, *, host: str = "127.0.0.1",
                      port: int = 0) -> RunningServer:
    """Start the engines and the gRPC server (port 0 = any free port), with the stage's own
    services and StageControlService."""
    for engine in bundle.engines:
        engine.start()
    control = StageControl(bundle.name, bundle.engines)

    def register(server: grpc.aio.Server) -> None:
        bundle.register(server)
        add_control(server, control)

    return await start_server(register, [*bundle.service_names, CONTROL_SERVICE], host=host,
                              port=port, interceptors=server_interceptors(mesh_token()),
                              max_receive_bytes=bundle.max_receive_bytes)


async def stop_stage(bundle: StageBundle, server: RunningServer,
                     grace: float = SHUTDOWN_GRACE_S) -> None:
    """NOT_SERVING, let running RPCs finish within `grace`, then stop the engines."""
    await server.stop(grace)
    loop = asyncio.get_running_loop()
    for engine in bundle.engines:
        await loop.run_in_executor(None, engine.shutdown, True, grace)


async def drain_stage(bundle: StageBundle, server: RunningServer, grace: float) -> bool:
    """NOT_SERVING, refuse new starts, let admitted requests finish within `grace` seconds,
    abort the rest (reason SHUTDOWN), then stop the server once their streams have ended
    (`_flush`). Returns whether every request finished within the grace period."""
    await server.set_serving(False)
    refusing_since = time.monotonic()
    drained = await asyncio.gather(*(asyncio.to_thread(engine.shutdown, False, grace)
                                     for engine in bundle.engines))
    if not all(drained):
        log.warning("stage %s: requests still running after %.0f s of drain; aborting them",
                    bundle.name, grace)
        await asyncio.gather(*(asyncio.to_thread(engine.shutdown, True, SHUTDOWN_GRACE_S)
                               for engine in bundle.engines))
    await _flush(bundle, server, refusing_since)
    return all(drained)


async def _flush(bundle: StageBundle, server: RunningServer, refusing_since: float) -> None:
    """Stop the server once every stage stream has ended, and neither a stream opened nor the
    health turned NOT_SERVING (at `refusing_since`, monotonic) in the last QUIET_S; all within
    FLUSH_GRACE_S. Until then the server answers: results and aborts still being written
    reach their gateways, and a start gets a refusal (the engines are closed) that its gateway
    retries on another replica. gRPC would cut both, stopping at once."""
    end = time.monotonic() + FLUSH_GRACE_S
    streams = [open_streams(engine) for engine in bundle.engines]

    def settled() -> bool:
        quiet_since = time.monotonic() - QUIET_S
        return refusing_since <= quiet_since and all(
            s.count == 0 and s.last_opened <= quiet_since for s in streams)

    while not settled() and time.monotonic() < end - STOP_GRACE_S:
        await asyncio.sleep(FLUSH_POLL_S)
    if not settled():
        log.warning("stage %s: stopping with %d stage streams open, %.1f s after the last "
                    "one opened", bundle.name, sum(s.count for s in streams),
                    time.monotonic() - max(s.last_opened for s in streams))
    await server.stop(max(end - time.monotonic(), STOP_GRACE_S))


class Ending(enum.Enum):
    """Why a stage process stops."""

    SIGNAL = 0  # SIGTERM / SIGINT: drain, exit 0
    ENGINE_DIED = 1  # an engine thread stopped on its own: exit 1, to be restarted


async def until_stopped(bundle: StageBundle, server: RunningServer) -> Ending:
    """Wait for SIGINT/SIGTERM, or an engine thread that stops on its own (health then turns
    NOT_SERVING at once: this replica can compute nothing more)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            if any(engine.stopped for engine in bundle.engines):
                log.error("stage %s: an engine thread stopped; reporting NOT_SERVING and "
                          "exiting", bundle.name)
                await server.set_serving(False)
                return Ending.ENGINE_DIED
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ENGINE_WATCH_S)
        return Ending.SIGNAL
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def serve_stage(bundle: StageBundle, *, host: str, port: int,
                      metrics_port: int | None,
                      runtime: RuntimeOptions | None = None) -> int:
    """Serve until SIGINT/SIGTERM, then drain (the `stagemesh stage` entry point); returns the
    process's exit status."""
    runtime = runtime or RuntimeOptions()
    if metrics_port:
        start_http_server(metrics_port, addr=host)
    server = await start_stage(bundle, host=host, port=port)
    log.info("stage %s ready on %s:%d (metrics %s) %s", bundle.name, host, server.port,
             metrics_port or "off", bundle.info)
    ending = await until_stopped(bundle, server)
    log.info("stage %s draining (up to %.0f s)", bundle.name, runtime.drain_grace_s)
    await drain_stage(bundle, server, runtime.drain_grace_s)
    log.info("stage %s stopped", bundle.name)
    return ending.value
