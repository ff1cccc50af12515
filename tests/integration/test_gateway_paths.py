"""The path of one request through the gateway, over fake stages: which gateway modules run
between a route handler's entry and its first stage call (few, each entered once), and the
paths that must stay short under load (health, oversized bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import stagemesh.gateway
from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.images.routes import ImageRoutes
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.gateway.wire.requests import TEXT_BODY_BYTES
from tests.integration.fake_stages import (
    REGISTER,
    FakeDit,
    FakeTokenizer,
    FakeVae,
    serve_fakes,
    stop_all,
)

pytestmark = pytest.mark.timeout(120)

GATEWAY = Path(stagemesh.gateway.__file__).resolve().parent
GRPC = Path(grpc.__file__).resolve().parent
#: The most gateway modules a non-streamed image request may run before its first stage call.
MAX_MODULES = 8


@dataclass
class Gateway:
    core: GatewayCore
    client: httpx.AsyncClient
    dit: FakeDit


class BusyHealth(health_pb2_grpc.HealthServicer):
    """A stage's grpc.health that answers late while the stage holds requests (its event loop
    busy with them), as a real stage under load does."""

    def __init__(self, dit: FakeDit, busy_seconds: float) -> None:
        self.dit = dit
        self.busy_seconds = busy_seconds

    async def Check(self, request: Any, context: Any) -> Any:
        if self.dit.in_flight:
            await asyncio.sleep(self.busy_seconds)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    dit = FakeDit()
    servers, ports = await serve_fakes({"tokenizer": FakeTokenizer(), "vae": FakeVae()})
    servers["dit"] = grpc.aio.server()
    REGISTER["dit"](dit, servers["dit"])
    # late, but within the balancer's poll timeout: the replica stays routable
    health_pb2_grpc.add_HealthServicer_to_server(BusyHealth(dit, 0.5), servers["dit"])
    ports["dit"] = f"127.0.0.1:{servers['dit'].add_insecure_port('127.0.0.1:0')}"
    await servers["dit"].start()
    stages = {n: StageEndpoint(n, address) for n, address in ports.items()}
    recipe = Recipe("img", Task.TEXT_TO_IMAGE, "m", stages,
                    ImageDefaults(width=16, height=16, num_inference_steps=2))
    try:
        async with open_gateway({"img": recipe}) as core:
            transport = httpx.ASGITransport(app=build_rest_app(core))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                yield Gateway(core, client, dit)
    finally:
        await stop_all(servers)


def gateway_module(filename: str) -> str | None:
    """`images/routes` for .../gateway/images/routes.py; None outside the gateway."""
    path = Path(filename).resolve()
    if not path.is_relative_to(GATEWAY):
        return None
    return path.relative_to(GATEWAY).with_suffix("").as_posix()


@dataclass
class PathTrace:
    """The gateway modules entered, in order, from a handler's entry to the first call into
    grpc (the first stage RPC), and each module entered again from a module it had called."""

    entry: object
    modules: list[str]
    reentered: list[tuple[str, list[str]]]
    done: bool = False

    def __post_init__(self) -> None:
        self.traced = contextvars.ContextVar("traced", default=False)
        #: Frames already called: a coroutine resumed after an await is no new call.
        self.seen: set[FrameType] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or self.done or frame in self.seen:
            return
        self.seen.add(frame)
        if frame.f_code is self.entry and not self.traced.get():
            self.traced.set(True)  # this task, and every task it starts, is on the path
        if not self.traced.get():
            return
        if Path(frame.f_code.co_filename).resolve().is_relative_to(GRPC):
            self.done = True
            return
        module = gateway_module(frame.f_code.co_filename)
        if module is None:
            return
        if module not in self.modules:
            self.modules.append(module)
        callers = _callers(frame)
        if callers and callers[0] != module and module in callers:
            self.reentered.append((module, callers))


def _callers(frame: FrameType) -> list[str]:
    """The gateway modules below `frame` on its stack, nearest first, repeats merged."""
    modules: list[str] = []
    caller = frame.f_back
    while caller is not None:
        module = gateway_module(caller.f_code.co_filename)
        if module is not None and (not modules or modules[-1] != module):
            modules.append(module)
        caller = caller.f_back
    return modules


async def trace_image_request(client: httpx.AsyncClient) -> PathTrace:
    trace = PathTrace(ImageRoutes.generations.__code__, [], [])
    sys.setprofile(trace)
    try:
        response = await client.post("/v1/images/generations", json={"prompt": "a cat"})
    finally:
        sys.setprofile(None)
    assert response.status_code == 200, response.text
    return trace


async def test_a_non_streamed_image_runs_few_gateway_modules_before_its_first_stage_call(
    gateway: Gateway,
) -> None:
    await gateway.client.post("/v1/images/generations", json={"prompt": "warm"})  # facts read
    trace = await trace_image_request(gateway.client)
    print("modules:", trace.modules)
    assert trace.done, "the request made no stage call"
    assert trace.modules[0] == "images/routes"
    assert len(trace.modules) <= MAX_MODULES, trace.modules
    assert trace.reentered == []


# -- paths that stay short under load ------------------------------------------------------


def p99(samples: list[float]) -> float:
    return sorted(samples)[max(0, round(len(samples) * 0.99) - 1)]


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects that exist now left out of garbage collection while the test measures the
    gateway's loop. A full collection in a process that has only imported torch, diffusers and
    transformers (450k objects) took 0.35 s on the 2-core host, more in a test process that has
    run the suite so far (CI saw one /health probe take 0.69 s while every other took 1 ms).
    That heap is the test process's: `stagemesh serve`'s gateway process imports none of
    those, and the stage processes the launcher forks have the imported heap frozen
    (`launcher.server.preload`)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def test_health_answers_fast_while_300_requests_are_held_by_slow_stages(
    gateway: Gateway,
) -> None:
    gateway.dit.step_seconds = {seed: 30.0 for seed in range(300)}  # every request is held
    with heap_frozen():
        held = [asyncio.create_task(gateway.client.post(
            "/v1/images/generations", json={"prompt": "a cat", "seed": seed}, timeout=60))
            for seed in range(300)]
        try:
            await asyncio.sleep(1.0)  # admitted ones are in the DiT, the others answered 429
            latencies = []
            for _ in range(40):
                started = time.perf_counter()
                response = await gateway.client.get("/health")
                latencies.append(time.perf_counter() - started)
                assert response.status_code in (200, 503) and "stages" in response.json()
                await asyncio.sleep(0.02)
            answered = [task.result().status_code for task in held if task.done()]
            assert gateway.dit.in_flight > 0 and set(answered) <= {429}
            assert p99(latencies) < 0.2, sorted(latencies)[-5:]
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


async def test_a_30_mb_json_body_on_a_text_route_is_refused_without_stalling_others(
    gateway: Gateway,
) -> None:
    chunk = b" " * (1024 * 1024)
    sent = 0

    async def body() -> AsyncIterator[bytes]:  # no Content-Length: refused as it passes the cap
        nonlocal sent
        for _ in range(30):
            sent += 1
            yield chunk
            await asyncio.sleep(0)

    async def probe() -> list[float]:
        latencies = []
        while not refused.done():
            started = time.perf_counter()
            assert (await gateway.client.get("/v1/models")).status_code == 200
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
        return latencies

    refused = asyncio.create_task(gateway.client.post(
        "/v1/images:generate", content=body(), headers={"content-type": "application/json"}))
    latencies = await probe()
    response = await refused
    assert response.status_code == 413 and response.json()["error"]["param"] == "body"
    assert sent <= TEXT_BODY_BYTES // len(chunk) + 2  # the rest was never read
    assert max(latencies) < 0.5
    declared = await gateway.client.post("/v1/images:generate", content=b"{}", headers={
        "content-type": "application/json", "content-length": str(30 * 1024 * 1024)})
    assert declared.status_code == 413  # refused before a byte is read
