"""`stagemesh serve`: start every stage the recipes need (one process per replica), then the
gateway, and keep the stages running.

This process hosts the gateway, so it never imports torch, diffusers, transformers or
stagemesh.models: its children do. They come from the stage launcher (`stagemesh.launcher`), one
child process that imports those once and forks each of them, so that none imports them again
(~6.5 s of CPU each; most of serve's start-up on two cores before it). Without it
(STAGEMESH_STAGE_LAUNCHER=spawn, elsewhere than Linux, or once it is gone) each child is
`python -m stagemesh ...` and imports them itself. First one `stagemesh model prepare SPEC...`
child resolves the distinct models of the recipes (a built-in one built on first use) and
prints their folders. Then `stagemesh stage ...` — the same entry point a Kubernetes Deployment
runs — runs once per replica a stage address lists (`ipv4:h:p1,h:p2`, or `--replicas dit=2`),
and the gateway waits until each reports SERVING on grpc.health, from the process serve started
(the pid its load report gives; another process answering on the port is an error, as is a port
already in use before start).

Supervision: a stage process that exits is restarted, with a backoff (1 s, doubling up to
60 s; back to 1 s once a process has stayed up for a minute), and logged; the gateway routes
around it meanwhile and sends it traffic again once it serves. No orphans: each child gets
SIGTERM when serve dies, even by `kill -9` (Linux PR_SET_PDEATHSIG, see `cli.die_with_parent`);
a forked one when the launcher dies, which dies with serve. Ctrl-C (SIGINT) or SIGTERM stops
the gateway, then the stages, each with a grace period, then the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from stagemesh.cli import PARENT_PID_ENV, stage_threads, usable_cores
from stagemesh.gateway.app import GatewayConfig, run_gateway
from stagemesh.gateway.recipes import Recipe, StageEndpoint, TargetKind, split_host_port
from stagemesh.launcher import ChildProcess, Launcher, LauncherUnavailable, StartMode, start_mode
from stagemesh.shared import eventloop
from stagemesh.shared.mesh_auth import METADATA_KEY, ensure_mesh_token, mesh_token
from stagemesh.shared.proto.v1 import control_service_pb2, control_service_pb2_grpc

log = logging.getLogger(__name__)

MODEL_PREPARE_TIMEOUT_S = 600.0  # building a seeded built-in model the first time
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


class PortInUse(RuntimeError):
    """A port a stage of this mesh needs is taken by another process."""


@dataclass(frozen=True)
class StageLaunch:
    """One stage process to start: one replica of a stage."""

    endpoint: StageEndpoint
    model_dir: Path
    replica: str = ""  # its host:port; "" = the endpoint's first replica
    index: int = 0  # its position in the endpoint's replicas (its metrics port)

    @property
    def address(self) -> str:
        return self.replica or self.endpoint.replicas[0]

    @property
    def metrics_port(self) -> int | None:
        return self.endpoint.metrics_port_of(self.index)

    @property
    def name(self) -> str:
        """For logs: the stage, and the replica when the stage has several."""
        several = len(self.endpoint.replicas) > 1
        return f"{self.endpoint.name} ({self.address})" if several else self.endpoint.name


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _replica_target(host: str, ports: list[int]) -> str:
    """`host:port` for one replica, an `ipv4:`/`ipv6:` list for several."""
    if len(ports) == 1:
        return f"{host}:{ports[0]}"
    ip = ipaddress.ip_address(socket.gethostbyname(host) if not _is_ip(host) else host)
    scheme, shown = ("ipv6", f"[{ip}]") if ip.version == 6 else ("ipv4", str(ip))
    return f"{scheme}:" + ",".join(f"{shown}:{port}" for port in ports)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def with_free_ports(recipes: dict[str, Recipe],
                    replicas: Mapping[str, int] | None = None) -> dict[str, Recipe]:
    """The same recipes with every stage moved to free ports (tests, side-by-side meshes), and
    with `replicas[stage]` replicas of the stages it names (each on its own free port, with
    its own metrics port)."""
    replicas = dict(replicas or {})
    moved: dict[str, StageEndpoint] = {}
    result = {}
    for name, recipe in recipes.items():
        stages = {}
        for stage, endpoint in recipe.stages.items():
            if endpoint.address not in moved:
                moved[endpoint.address] = _moved(endpoint, replicas.get(
                    stage, max(1, len(endpoint.replicas))))
            stages[stage] = moved[endpoint.address]
        result[name] = dataclasses.replace(recipe, stages=stages)
    return result


def _moved(endpoint: StageEndpoint, count: int) -> StageEndpoint:
    host = endpoint.host
    ports = [free_port(host) for _ in range(count)]
    metrics = [free_port(host) for _ in range(count)] if endpoint.metrics_port else []
    return dataclasses.replace(
        endpoint, address=_replica_target(host, ports),
        metrics_port=metrics[0] if metrics else None,
        replica_metrics_ports=tuple(metrics) if count > 1 else ())


def parse_replicas(text: str) -> dict[str, int]:
    """`dit=2,vae=2` -> {"dit": 2, "vae": 2}; ValueError naming the bad part."""
    counts: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        stage, sep, count = part.partition("=")
        if not sep or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--replicas: expected STAGE=N with N >= 1, got {part!r}")
        counts[stage.strip()] = int(count)
    return counts


def plan_launches(recipes: Mapping[str, Recipe], model_dirs: Mapping[str, Path]
                  ) -> list[StageLaunch]:
    """One launch per replica of each distinct stage address, with its recipe's model folder
    from `model_dirs` (model spec -> folder, as `prepare_models` returns). A `dns:` address
    names replicas serve cannot start: ValueError."""
    launches: dict[str, StageLaunch] = {}
    for recipe in recipes.values():
        for endpoint in recipe.stages.values():
            if endpoint.target.kind is TargetKind.DNS:
                raise ValueError(f"stage {endpoint.name}: {endpoint.address} is a DNS target; "
                                 "`stagemesh serve` starts stages on this machine, so list "
                                 "their ports (ipv4:127.0.0.1:P1,127.0.0.1:P2) or use "
                                 "`stagemesh gateway` beside stages run elsewhere")
            for index, replica in enumerate(endpoint.replicas):
                if replica not in launches:
                    launches[replica] = StageLaunch(endpoint, model_dirs[recipe.model],
                                                    replica, index)
    return list(launches.values())


def _port_free(host: str, port: int) -> bool:
    """Whether a listener could bind host:port now (as a gRPC server does: SO_REUSEADDR, no
    SO_REUSEPORT, so a port another process listens on is refused)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_ports_free(launches: Iterable[StageLaunch]) -> None:
    """Raise PortInUse naming the stage and the port if a stage's port is taken."""
    for launch in launches:
        host, port = split_host_port(launch.address)
        ports = [("gRPC", port)]
        if launch.metrics_port:
            ports.append(("metrics", launch.metrics_port))
        for kind, number in ports:
            if not _port_free(host, number):
                raise PortInUse(f"stage {launch.name}: {kind} port {host}:{number} is already in "
                                "use (another mesh on this machine?); stop it, change the "
                                "recipe's ports, or use --stage-ports auto")


def _stagemesh_command(*args: str) -> list[str]:
    """`python -m stagemesh ARGS` with this interpreter (the same install as this process)."""
    return [sys.executable, "-m", "stagemesh", *args]


def _child_env() -> dict[str, str]:
    """The environment of serve's children: offline, and told to die with this process."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            PARENT_PID_ENV: str(os.getpid())}


def start_child(argv: Sequence[str], launcher: Launcher | None = None,
                stdout: int | None = None) -> ChildProcess:
    """`stagemesh ARGV` as a child of serve (with `stdout` as its stdout): forked by the
    launcher, which has torch & co. imported already; spawned as `python -m stagemesh ARGV`
    without one, or once it is gone (it logs why)."""
    env = _child_env()
    if launcher is not None:
        with contextlib.suppress(LauncherUnavailable):
            return launcher.run(argv, env, stdout)
    return subprocess.Popen(_stagemesh_command(*argv), env=env, stdout=stdout)


def _read_to_end(fd: int, deadline: float) -> bytes:
    """Everything written to the pipe `fd` until its writers close it; TimeoutError after
    `deadline` (time.monotonic)."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def prepare_models(specs: Iterable[str], timeout: float = MODEL_PREPARE_TIMEOUT_S,
                   launcher: Launcher | None = None) -> dict[str, Path]:
    """Model spec -> folder, every distinct spec resolved by one `stagemesh model prepare`
    child (forked by `launcher` when given), so that building a model never loads torch into
    this process (and torch is imported once for all the specs)."""
    distinct = list(dict.fromkeys(specs))
    if not distinct:
        return {}
    deadline = time.monotonic() + timeout
    read_end, write_end = os.pipe()
    try:
        try:
            child = start_child(["model", "prepare", *distinct], launcher, stdout=write_end)
        finally:
            os.close(write_end)  # the child has its own: the pipe ends when the child does
        try:
            out = _read_to_end(read_end, deadline)
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, subprocess.TimeoutExpired) as error:
            child.kill()
            child.wait()
            raise TimeoutError(f"preparing models {distinct} took longer than {timeout:.0f} s"
                               ) from error
    finally:
        os.close(read_end)
    folders = out.decode().splitlines()
    if child.returncode != 0 or len(folders) != len(distinct):
        failed = distinct[min(len(folders), len(distinct) - 1)]  # one line per spec done
        raise RuntimeError(f"preparing model {failed!r} failed (exit code {child.returncode}); "
                           "its error is logged above")
    return {spec: Path(folder) for spec, folder in zip(distinct, folders, strict=True)}


def stage_argv(launch: StageLaunch) -> list[str]:
    """`stage ...`, the arguments of `stagemesh` for a launch, with its torch threads chosen
    here (see `stagemesh.cli.stage_threads`), so that the log says what each stage runs with.
    The port comes first: a forked stage shows them as its command line, cut to the length
    of the launcher's (see `launcher._retitle`)."""
    endpoint = launch.endpoint
    host, port = split_host_port(launch.address)
    argv = ["stage", endpoint.name, "--port", str(port), "--host", host,
            "--model", str(launch.model_dir), "--options", json.dumps(endpoint.options),
            "--threads", str(stage_threads(endpoint.name))]
    if launch.metrics_port:
        argv += ["--metrics-port", str(launch.metrics_port)]
    return argv


def stage_command(launch: StageLaunch) -> list[str]:
    """`python -m stagemesh stage ...`: how a launch runs without the launcher."""
    return _stagemesh_command(*stage_argv(launch))


def spawn_stage(launch: StageLaunch, launcher: Launcher | None = None) -> ChildProcess:
    log.info("starting stage %s on %s (torch threads: %d; usable cores: %d)",
             launch.endpoint.name, launch.address, stage_threads(launch.endpoint.name),
             usable_cores())
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


async def run_gateway_until_signal(recipes: dict[str, Recipe], config: GatewayConfig,
                                   supervisor: Supervisor | None = None) -> None:
    """The gateway (and the supervisor, if given) until SIGINT or SIGTERM."""
    stop = asyncio.Event()

    def on_signal() -> None:
        if supervisor is not None:  # Ctrl-C reaches the stages too: none is restarted now
            supervisor.stopping = True
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    watching = asyncio.create_task(supervisor.supervise()) if supervisor else None
    try:
        await run_gateway(recipes, config, stop=stop)
    finally:
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching


def serve(recipes: dict[str, Recipe], config: GatewayConfig) -> None:
    """Prepare models, start stages, wait for them, run the gateway (and restart stages that
    exit) until Ctrl-C, then stop."""
    ensure_mesh_token()  # before any child starts: they inherit it through the environment
    launcher = Launcher.start(_child_env()) if start_mode() is StartMode.FORK else None
    supervisor: Supervisor | None = None
    try:
        launches = plan_launches(recipes, prepare_models(
            (r.model for r in recipes.values()), launcher=launcher))
        supervisor = Supervisor(launches, launcher)
        supervisor.start_all()
        eventloop.run(run_gateway_until_signal(recipes, config, supervisor))  # STAGEMESH_UVLOOP
    except KeyboardInterrupt:
        pass
    finally:
        if supervisor is not None:
            supervisor.stop()
        if launcher is not None:
            launcher.close()
