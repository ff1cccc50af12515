"""Faults a mesh must survive, with every stage a real `stagemesh stage` process (carrying a
mesh token, forked by the stage launcher as `serve` runs them, so that torch & co. are imported
once, not once a stage) and the gateway's REST app over them: a stage killed
mid-request, a stage slower than the request's deadline, a stage restarted, and more requests
than the gateway admits.

What a client sees: 503 naming the stage that went away (and requests that do not need it go
on), 504 when the deadline passes (and the stage stops the work at its next step), service
again once the stage is back, 429 with Retry-After when the gateway is full.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.gateway.wire.admission import Admission
from stagemesh.launcher import ChildProcess, Launcher
from stagemesh.models.qwen_image import ensure_model
from stagemesh.models.speech import ensure_speech_model
from stagemesh.serve import HEALTH_CHECK_METHOD, free_port
from stagemesh.serve.children import child_env, start_child
from stagemesh.shared import mesh_auth

pytestmark = pytest.mark.timeout(240)

TOKEN = "fault-suite-mesh-token-0123456789"
#: The DiT allows long requests, so one is still denoising when the fault strikes.
OPTIONS: dict[str, dict[str, object]] = {"dit": {"max_steps": 1000}}
#: Every stage's drain on SIGTERM (the suite's teardown): a second, not the default 30.
DRAIN = {"drain_grace_s": 1}
#: A request that runs for seconds on the tiny DiT (milliseconds a step).
LONG_STEPS = 600
LONG_IMAGE = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": LONG_STEPS}
SHORT_IMAGE = {"prompt": "a red circle", "size": "32x32", "num_inference_steps": 2}
SPEECH = {"model": "speech", "input": "Hello there.", "seed": 1, "max_new_tokens": 4}
START_TIMEOUT_S = 180.0


class StageProcess:
    """One `stagemesh stage` child on fixed ports (so it can be restarted where it was)."""

    def __init__(self, name: str, model: Path, launcher: Launcher) -> None:
        self.name, self.model, self.launcher = name, model, launcher
        self.port, self.metrics_port = free_port(), free_port()
        self.process: ChildProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """As serve starts a stage (`start_child`: offline, with this process's environment,
        which carries the token while the module runs)."""
        self.process = start_child(
            ["stage", self.name, "--model", str(self.model), "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--threads", "1",
             "--options", json.dumps({**OPTIONS.get(self.name, {}), **DRAIN})],
            self.launcher)

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll grpc.health (open without the token) until SERVING; a new channel each try,
        so a refused connect before the server binds costs no reconnect backoff."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, (
                f"stage {self.name} exited during start-up")
            if self._serving():
                return
            time.sleep(0.2)
        raise TimeoutError(f"stage {self.name} not serving after {timeout} s")

    def _serving(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            check = channel.unary_unary(
                HEALTH_CHECK_METHOD,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString)
            try:
                reply = check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        if self.process is not None:
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str) -> float:
        """One series of the stage's /metrics (its own stage label), 0 when absent."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(f'{name}{{stage="{self.name}"}} '):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def stages() -> Iterator[dict[str, StageProcess]]:
    image, speech = ensure_model("tiny"), ensure_speech_model()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(mesh_auth.TOKEN_ENV, TOKEN)
        launcher = Launcher.start(child_env())
        stages = {name: StageProcess(name, model, launcher) for name, model in
                  [("tokenizer", image), ("dit", image), ("vae", image), ("talker", speech),
                   ("codec", speech)]}
        try:
            for stage in stages.values():
                stage.start()
            for stage in stages.values():
                stage.wait_serving()
            yield stages
        finally:
            for stage in stages.values():
                stage.terminate()  # all at once: they drain side by side
            for stage in stages.values():
                stage.wait_stopped()
            launcher.close()


@pytest.fixture
def dit(stages: dict[str, StageProcess]) -> StageProcess:
    """The DiT, serving (restarted if a test before this one killed it)."""
    dit = stages["dit"]
    assert dit.process is not None
    if dit.process.poll() is not None:
        dit.start()
        dit.wait_serving()
    return dit


def recipes(stages: dict[str, StageProcess]) -> dict[str, Recipe]:
    def endpoints(*names: str) -> dict[str, StageEndpoint]:
        return {name: StageEndpoint(name, stages[name].address) for name in names}

    return {
        "tiny": Recipe(name="tiny", task=Task.TEXT_TO_IMAGE, model=str(stages["dit"].model),
                       stages=endpoints("tokenizer", "dit", "vae"),
                       image_defaults=ImageDefaults(width=32, height=32,
                                                    num_inference_steps=2)),
        "speech": Recipe(name="speech", task=Task.TEXT_TO_SPEECH,
                         model=str(stages["talker"].model), stages=endpoints("talker", "codec")),
    }


@pytest.fixture
async def client(stages: dict[str, StageProcess], dit: StageProcess,
                 monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's REST app over the stage processes (admitting 2 requests at once), with
    the mesh token its channels must carry."""
    monkeypatch.setenv(mesh_auth.TOKEN_ENV, TOKEN)
    async with open_gateway(recipes(stages)) as core:
        app = build_rest_app(core, None, Admission(core, limit=2))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway", timeout=60) as client:
            yield client


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait, off the loop (the condition may scrape metrics), until `condition()` holds."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.05)


async def test_a_killed_stage_is_a_503_naming_it_others_go_on_and_it_comes_back(
    client: httpx.AsyncClient, dit: StageProcess
) -> None:
    """One kill, three answers: the request it was running, a request that needs no DiT, and
    the requests once the DiT is restarted where it was (one restart: each costs seconds)."""
    image = asyncio.create_task(client.post("/v1/images/generations", json=LONG_IMAGE))
    await until(lambda: dit.metric("stagemesh_steps_total") > 0, 60, "the DiT denoising")
    dit.kill()
    speech = await client.post("/v1/audio/speech", json=SPEECH)  # needs no DiT
    failed = await image
    assert failed.status_code == 503, failed.text
    assert "dit" in failed.json()["error"]["message"]
    assert speech.status_code == 200, speech.text
    assert speech.content[:4] == b"RIFF"
    down = await client.post("/v1/images/generations", json=SHORT_IMAGE)
    assert down.status_code == 503, down.text

    await asyncio.to_thread(dit.start)
    await asyncio.to_thread(dit.wait_serving)
    statuses = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the channel reconnects with a short backoff
        answer = await client.post("/v1/images/generations", json=SHORT_IMAGE)
        statuses.append(answer.status_code)
        if answer.status_code == 200:
            break
        await asyncio.sleep(0.5)
    assert statuses[-1] == 200, statuses
    assert set(statuses) <= {200, 503}, statuses


async def test_past_its_deadline_a_request_is_a_504_and_the_stage_stops(
    client: httpx.AsyncClient, dit: StageProcess
) -> None:
    steps_before = dit.metric("stagemesh_steps_total")
    started = time.monotonic()
    late = await client.post("/v1/images/generations", json={**LONG_IMAGE, "timeout": 1.5})
    assert late.status_code == 504, late.text
    assert time.monotonic() - started < 10
    await until(lambda: dit.metric("stagemesh_requests_running") == 0, 10,
                "the DiT dropping the request")
    stopped_at = dit.metric("stagemesh_steps_total")
    assert stopped_at - steps_before < LONG_STEPS
    await asyncio.sleep(0.5)
    assert dit.metric("stagemesh_steps_total") == stopped_at  # no step after the drop


async def test_over_the_limit_a_request_is_a_429_with_retry_after(
    client: httpx.AsyncClient, dit: StageProcess
) -> None:
    held = [asyncio.create_task(client.post("/v1/images/generations", json=LONG_IMAGE))
            for _ in range(2)]
    await until(lambda: dit.metric("stagemesh_requests_running") == 2, 60,
                "both admitted requests running")
    refused = await client.post("/v1/images/generations", json=SHORT_IMAGE)
    for task in held:  # the client goes away: the gateway cancels them
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    await until(lambda: dit.metric("stagemesh_requests_running") == 0, 10,
                "the DiT dropping the cancelled requests")
