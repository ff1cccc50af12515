"""The path of one request through the gateway, over fake stages: which gateway modules run
between a route handler's entry and its first stage call (few, each entered once), and the
paths that must stay short under load (health, oversized bodies)."""

from __future__ import annotations

import contextvars
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import grpc
import httpx
import pytest

import stagemesh.gateway
from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.images.routes import ImageRoutes
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from tests.integration.fake_stages import FakeDit, FakeTokenizer, FakeVae, serve_fakes, stop_all

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


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    dit = FakeDit()
    servers, ports = await serve_fakes({"tokenizer": FakeTokenizer(), "dit": dit,
                                        "vae": FakeVae()})
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
