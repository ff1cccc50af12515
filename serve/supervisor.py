"""The supervisor of `stagemesh serve`: starts the stage processes, waits until each serves,
restarts any that exits, and stops them all.

Each stage must report SERVING on grpc.health from the process serve started (the pid its load
report gives; another process answering on the port is an error). A stage process that exits is
restarted, with a backoff (1 s, doubling up to 60 s; back to 1 s once a process has stayed up
for a minute), and logged; the gateway routes around it meanwhile and sends it traffic again
once it serves.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2

from stagemesh.launcher import ChildProcess, Launcher
from stagemesh.serve.children import start_child
from stagemesh.serve.plan import StageLaunch, stage_argv
from stagemesh.serve.ports import PortInUse, check_ports_free
from stagemesh.shared.mesh_auth import METADATA_KEY, mesh_token
from stagemesh.shared.process import usable_cores
from stagemesh.shared.proto.v1 import control_service_pb2, control_service_pb2_grpc

log = logging.getLogger(__name__)

STAGE_START_TIMEOUT_S = 180.0
#: A stage drains on SIGTERM (its `drain_grace_s`, 30 s by default, when requests still run);
#: serve waits this long for all of them, then kills what is left.
STAGE_STOP_TIMEOUT_S = 45.0
#: grpc.health.v1 Check, called by name: the stub package's HealthStub declares no methods.
HEALTH_CHECK_METHOD = f"/{health.SERVICE_NAME}/Check"
#: Restart backoff of a stage process that exited: first delay, cap, and the uptime after
#: which it counts as healthy again (the delay starts over).
RESTART_BACKOFF_S = 1.0
MAX_RESTART_BACKOFF_S = 60.0
HEALTHY_UPTIME_S = 60.0
SUPERVISE_INTERVAL_S = 0.5


def spawn_stage(launch: StageLaunch, launcher: Launcher | None = None) -> ChildProcess:
    log.info("starting stage %s on %s (torch threads: %d; usable cores: %d)",
             launch.endpoint.name, launch.address, launch.threads, usable_cores())
    return start_child(stage_argv(launch), launcher)


def _serving_pid(channel: grpc.Channel) -> int | None:
    """The pid of the stage answering on `channel` once it reports SERVING; None before."""
    check = channel.unary_unary(
        HEALTH_CHECK_METHOD, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
    token = mesh_token()
    metadata = ((METADATA_KEY, token),) if token else None
    try:
        reply = check(health_pb2.HealthCheckRequest(), timeout=1.0)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return None
        load = control_service_pb2_grpc.StageControlServiceStub(channel).GetStageLoad(
            control_service_pb2.GetStageLoadRequest(), timeout=1.0, metadata=metadata)
    except grpc.RpcError:
        return None
    return int(load.pid)


def wait_serving(launch: StageLaunch, process: ChildProcess,
                 timeout: float = STAGE_START_TIMEOUT_S) -> None:
    """Poll until the process serve started reports SERVING; fail fast if it dies, or if
    another process answers on its port."""
    deadline = time.monotonic() + timeout
    # gRPC's reconnect backoff grows to minutes while the stage loads its model; cap it so
    # the poll sees the stage within a second of it serving.
    with grpc.insecure_channel(launch.address, options=[
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000)]) as channel:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"stage {launch.name} exited with code "
                                   f"{process.returncode} during start-up")
            pid = _serving_pid(channel)
            if pid is not None and pid != process.pid:
                raise PortInUse(f"stage {launch.name}: {launch.address} is served by another "
                                f"process (pid {pid}), not the one serve started "
                                f"(pid {process.pid})")
            if pid == process.pid:
                return
            time.sleep(0.2)
    raise TimeoutError(f"stage {launch.name} not SERVING after {timeout:.0f} s")


def stop_processes(processes: Sequence[ChildProcess]) -> None:
    """SIGTERM all (they drain), then SIGKILL what is left after the grace period."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STAGE_STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("stage pid %d did not stop in time; killing it", process.pid)
            process.kill()
            process.wait()


@dataclass
class StageProcess:
    """A launch and the process that runs it now, with its restart bookkeeping."""

    launch: StageLaunch
    process: ChildProcess
    started_at: float = field(default_factory=time.monotonic)
    backoff: float = RESTART_BACKOFF_S
    restart_at: float | None = None  # when it exited: when it is started again
    restarting: bool = False  # being started again (off the event loop)


class Supervisor:
    """Starts the stage processes and restarts any that exits (see the module docstring)."""

    def __init__(self, launches: list[StageLaunch], launcher: Launcher | None = None) -> None:
        self.launches = launches
        self.launcher = launcher  # forks the stages (restarts too) while it is there
        self.stages: list[StageProcess] = []
        self.stopping = False
        self._waits: set[asyncio.Task[None]] = set()  # restarted stages coming up

    @property
    def processes(self) -> list[ChildProcess]:
        return [stage.process for stage in self.stages]

    def start_all(self) -> None:
        """Spawn every stage, then wait for each (serve's own process) to serve."""
        check_ports_free(self.launches)
        for launch in self.launches:
            self.stages.append(StageProcess(launch, spawn_stage(launch, self.launcher)))
        for stage in self.stages:
            wait_serving(stage.launch, stage.process)
        log.info("all %d stage processes are serving", len(self.stages))

    async def supervise(self) -> None:
        """Restart exited stages until cancelled (runs beside the gateway)."""
        while not self.stopping:
            now = time.monotonic()
            for stage in self.stages:
                self._check(stage, now)
            self._waits = {task for task in self._waits if not task.done()}
            await asyncio.sleep(SUPERVISE_INTERVAL_S)

    def _check(self, stage: StageProcess, now: float) -> None:
        if stage.restarting or stage.process.poll() is None or self.stopping:
            return
        if stage.restart_at is None:
            if now - stage.started_at >= HEALTHY_UPTIME_S:
                stage.backoff = RESTART_BACKOFF_S
            stage.restart_at = now + stage.backoff
            log.error("stage %s (pid %d) exited with code %s; restarting it in %.0f s",
                      stage.launch.name, stage.process.pid, stage.process.returncode,
                      stage.backoff)
            stage.backoff = min(stage.backoff * 2, MAX_RESTART_BACKOFF_S)
        elif now >= stage.restart_at:
            stage.restarting = True
            self._waits.add(asyncio.create_task(self._restart(stage)))

    async def _restart(self, stage: StageProcess) -> None:
        """Start the stage again, then log when it serves (or kill it if it does not). The
        start runs off the event loop: asking the launcher waits for its answer, and the
        gateway shares this loop."""
        try:
            process = await asyncio.to_thread(spawn_stage, stage.launch, self.launcher)
        except OSError as error:  # no process could be started: try again after the backoff
            log.error("could not start stage %s again: %s", stage.launch.name, error)
            stage.restart_at = time.monotonic() + stage.backoff
            stage.restarting = False
            return
        stage.process, stage.started_at, stage.restart_at = process, time.monotonic(), None
        stage.restarting = False
        try:
            await asyncio.to_thread(wait_serving, stage.launch, stage.process)
        except (RuntimeError, TimeoutError) as error:
            log.error("restarted stage %s did not come up: %s", stage.launch.name, error)
            if stage.process.poll() is None:
                stage.process.kill()
            return
        log.info("stage %s restarted (pid %d); it takes traffic again", stage.launch.name,
                 stage.process.pid)

    def stop(self) -> None:
        self.stopping = True
        log.info("stopping %d stage processes", len(self.stages))
        stop_processes(self.processes)


