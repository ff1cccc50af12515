"""`stagemesh serve` as a subprocess on free ports, driven by real clients."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from stagemesh.serve import free_port

START_TIMEOUT_S = 240
#: How often a bounded wait checks its condition.
POLL_S = 0.05


def wait_until(condition: Callable[[], bool], timeout: float = 30.0,
               what: str = "the condition") -> None:
    """Return as soon as `condition()` holds; fail the test if it does not within `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(POLL_S)


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., None]:
    """The bounded wait above, for tests (synchronise on a condition, never on a sleep)."""
    return wait_until


def process_tree(pid: int) -> dict[int, str]:
    """pid -> command line of every descendant of `pid`: serve's stages are children of its
    stage launcher, or its own children when spawned (STAGEMESH_STAGE_LAUNCHER=spawn)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    tree, frontier = {}, {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        for child in frontier:
            try:
                tree[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(
                    b"\0", b" ").decode()
            except OSError:
                continue
    return tree


def stage_processes(pid: int) -> dict[int, str]:
    """pid -> command line of the `stagemesh stage` processes below `pid`."""
    return {child: cmd for child, cmd in process_tree(pid).items() if " stage " in f" {cmd} "}


@dataclass
class Served:
    http_url: str
    grpc_target: str
    process: subprocess.Popen[bytes]
    _metrics_urls: dict[str, str] = field(default_factory=dict)

    def stages(self) -> dict[str, dict[str, str]]:
        """name -> stage info (address, health, metrics_url) from GET /v1/stages."""
        stages = httpx.get(f"{self.http_url}/v1/stages", timeout=10).json()["stages"]
        return {s["name"]: s for s in stages}

    def metrics(self, stage: str, recipe: str = "") -> dict[str, float]:
        """One stage's /metrics as {'name{label="v",...}': value}, labels sorted. `recipe`
        picks that recipe's stage where several recipes have a stage of this name."""
        where = f"{recipe}/{stage}" if recipe else stage
        if where not in self._metrics_urls:
            self._metrics_urls.update({n: s["metrics_url"] for n, s in self.stages().items()})
            listed = httpx.get(f"{self.http_url}/v1/stages", timeout=10).json()["stages"]
            self._metrics_urls.update({f"{s['recipe']}/{s['name']}": s["metrics_url"]
                                       for s in listed})
        samples = {}
        for line in httpx.get(self._metrics_urls[where], timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name, _, labels = series.partition("{")
                key = f"{name}{{{','.join(sorted(labels.rstrip('}').split(',')))}}}"
                samples[key] = float(value)
        return samples

    def metric(self, stage: str, name: str, *, recipe: str = "", **labels: str) -> float:
        """One sample of a stage's metrics (0 when the series does not exist yet)."""
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted({"stage": stage, **labels}.items()))
        return self.metrics(stage, recipe).get(f"{name}{{{wanted}}}", 0.0)


def start_serve(*extra: str, env: Mapping[str, str] | None = None,
                stderr: Path | None = None) -> Served:
    """`stagemesh serve EXTRA...` on free ports, once /health answers 200 (in `env`, else this
    process's environment; its stderr to the file `stderr`, else this process's)."""
    http_port, grpc_port = free_port(), free_port()
    with contextlib.ExitStack() as files:
        process = subprocess.Popen(
            [sys.executable, "-m", "stagemesh", "serve", "--stage-ports", "auto",
             "--http-port", str(http_port), "--grpc-port", str(grpc_port), *extra],
            env={**(os.environ if env is None else env), "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1"},
            stderr=files.enter_context(stderr.open("wb")) if stderr else None)
    served = Served(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", process)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"stagemesh serve exited with {process.returncode}")
        try:
            if httpx.get(f"{served.http_url}/health", timeout=2).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_serve(served)
    raise TimeoutError("stagemesh serve did not become healthy")


def stop_serve(served: Served) -> int:
    served.process.send_signal(signal.SIGINT)
    try:
        return served.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        served.process.kill()
        return served.process.wait()


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    """The default mesh, exactly as README command 1 starts it (but on free ports)."""
    served = start_serve()
    yield served
    assert stop_serve(served) == 0, "Ctrl-C must shut the mesh down cleanly"
