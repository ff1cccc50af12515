"""`stagemesh serve`: start every stage the recipes need (one process each), then the gateway.

This process hosts the gateway, so it never imports torch, diffusers, transformers or
stagemesh.models: each distinct model of the recipes is resolved (a built-in one built on first
use) by a `stagemesh model prepare SPEC` child process, which prints the model's folder. Stages
are then started as `python -m stagemesh stage ...` subprocesses — the same entry point a
Kubernetes Deployment runs — and the gateway waits until each reports SERVING on grpc.health.
Ctrl-C (SIGINT) or SIGTERM stops the gateway, then the stages, each with a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from stagemesh.cli import stage_threads, usable_cores
from stagemesh.gateway.app import GatewayConfig, run_gateway
from stagemesh.gateway.recipes import Recipe, StageEndpoint

log = logging.getLogger(__name__)

MODEL_PREPARE_TIMEOUT_S = 600.0  # building a seeded built-in model the first time
STAGE_START_TIMEOUT_S = 180.0
STAGE_STOP_TIMEOUT_S = 15.0
#: grpc.health.v1 Check, called by name: the stub package's HealthStub declares no methods.
HEALTH_CHECK_METHOD = f"/{health.SERVICE_NAME}/Check"


@dataclass(frozen=True)
class StageLaunch:
    """One stage process to start."""

    endpoint: StageEndpoint
    model_dir: Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def with_free_ports(recipes: dict[str, Recipe]) -> dict[str, Recipe]:
    """The same recipes with every stage moved to free ports (tests, side-by-side meshes)."""
    moved: dict[str, StageEndpoint] = {}
    result = {}
    for name, recipe in recipes.items():
        stages = {}
        for stage, endpoint in recipe.stages.items():
            if endpoint.address not in moved:
                moved[endpoint.address] = dataclasses.replace(
                    endpoint, address=f"{endpoint.host}:{free_port(endpoint.host)}",
                    metrics_port=free_port(endpoint.host) if endpoint.metrics_port else None)
            stages[stage] = moved[endpoint.address]
        result[name] = dataclasses.replace(recipe, stages=stages)
    return result


def plan_launches(recipes: Mapping[str, Recipe], model_dirs: Mapping[str, Path]
                  ) -> list[StageLaunch]:
    """One launch per distinct stage address, with its recipe's model folder from `model_dirs`
    (model spec -> folder, as `prepare_models` returns)."""
    launches: dict[str, StageLaunch] = {}
    for recipe in recipes.values():
        for endpoint in recipe.stages.values():
            if endpoint.address not in launches:
                launches[endpoint.address] = StageLaunch(endpoint, model_dirs[recipe.model])
    return list(launches.values())


def _stagemesh_command(*args: str) -> list[str]:
    """`python -m stagemesh ARGS` with this interpreter (the same install as this process)."""
    return [sys.executable, "-m", "stagemesh", *args]


def _child_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def prepare_models(specs: Iterable[str], timeout: float = MODEL_PREPARE_TIMEOUT_S
                   ) -> dict[str, Path]:
    """Model spec -> folder, each distinct spec resolved by its own `stagemesh model prepare`
    child (all at once), so that building a model never loads torch into this process."""
    children = {spec: subprocess.Popen(_stagemesh_command("model", "prepare", spec),
                                       stdout=subprocess.PIPE, env=_child_env())
                for spec in dict.fromkeys(specs)}
    deadline = time.monotonic() + timeout
    try:
        return {spec: _prepared_folder(spec, child, deadline, timeout)
                for spec, child in children.items()}
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()


def _prepared_folder(spec: str, child: subprocess.Popen[bytes], deadline: float,
                     timeout: float) -> Path:
    """The folder a `model prepare` child printed last, once it exits (by `deadline`)."""
    try:
        out, _ = child.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as error:
        raise TimeoutError(f"preparing model {spec!r} took longer than {timeout:.0f} s"
                           ) from error
    lines = out.decode().splitlines()
    if child.returncode != 0 or not lines:
        raise RuntimeError(f"preparing model {spec!r} failed (exit code {child.returncode}); "
                           "its error is logged above")
    return Path(lines[-1])


def stage_command(launch: StageLaunch) -> list[str]:
    """`stagemesh stage ...` for a launch, with its torch threads chosen here (see
    `stagemesh.cli.stage_threads`), so that the log says what each stage runs with."""
    endpoint = launch.endpoint
    command = _stagemesh_command(
        "stage", endpoint.name, "--host", endpoint.host, "--port", str(endpoint.port),
        "--model", str(launch.model_dir), "--options", json.dumps(endpoint.options),
        "--threads", str(stage_threads(endpoint.name)))
    if endpoint.metrics_port:
        command += ["--metrics-port", str(endpoint.metrics_port)]
    return command


def spawn_stage(launch: StageLaunch) -> subprocess.Popen[bytes]:
    endpoint = launch.endpoint
    log.info("starting stage %s on %s (torch threads: %d; usable cores: %d)", endpoint.name,
             endpoint.address, stage_threads(endpoint.name), usable_cores())
    return subprocess.Popen(stage_command(launch), env=_child_env())


def wait_serving(launch: StageLaunch, process: subprocess.Popen[bytes],
                 timeout: float = STAGE_START_TIMEOUT_S) -> None:
    """Poll grpc.health until SERVING; fail fast if the process dies."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(launch.endpoint.address) as channel:
        check = channel.unary_unary(
            HEALTH_CHECK_METHOD, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"stage {launch.endpoint.name} exited with code "
                                   f"{process.returncode} during start-up")
            with contextlib.suppress(grpc.RpcError):
                reply = check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"stage {launch.endpoint.name} not SERVING after {timeout:.0f} s")


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
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


async def run_gateway_until_signal(recipes: dict[str, Recipe], config: GatewayConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_gateway(recipes, config, stop=stop)


def serve(recipes: dict[str, Recipe], config: GatewayConfig) -> None:
    """Prepare models, start stages, wait for them, run the gateway until Ctrl-C, then stop."""
    launches = plan_launches(recipes, prepare_models(r.model for r in recipes.values()))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for launch in launches:
            processes.append(spawn_stage(launch))
        for launch, process in zip(launches, processes, strict=True):
            wait_serving(launch, process)
        log.info("all %d stages are serving", len(launches))
        asyncio.run(run_gateway_until_signal(recipes, config))
    except KeyboardInterrupt:
        pass
    finally:
        log.info("stopping %d stage processes", len(processes))
        stop_processes(processes)
