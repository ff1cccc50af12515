"""`stagemesh serve` as a subprocess on free ports, driven by real clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from stagemesh.serve import free_port

START_TIMEOUT_S = 240


@dataclass(frozen=True)
class Served:
    http_url: str
    grpc_target: str
    process: subprocess.Popen[bytes]

    def stages(self) -> dict[str, dict[str, str]]:
        """name -> stage info (address, health, metrics_url) from GET /v1/stages."""
        stages = httpx.get(f"{self.http_url}/v1/stages", timeout=10).json()["stages"]
        return {s["name"]: s for s in stages}

    def metric(self, stage: str, name: str, **labels: str) -> float:
        """Read one sample from a stage's /metrics (Prometheus text format)."""
        text = httpx.get(self.stages()[stage]["metrics_url"], timeout=10).text
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted({"stage": stage, **labels}.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{"):
                series, value = line.rsplit(" ", 1)
                got = ",".join(sorted(series[len(name) + 1:-1].split(",")))
                if got == wanted:
                    return float(value)
        return 0.0


def start_serve(*extra: str) -> Served:
    http_port, grpc_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "stagemesh", "serve", "--stage-ports", "auto",
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), *extra],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
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
