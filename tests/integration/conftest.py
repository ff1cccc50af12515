"""Real stage servers on loopback (port 0), in this process, with the tiny seeded model."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.models.qwen_image import ensure_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage

IMAGE_STAGES = ("tokenizer", "dit", "vae")
#: Stage options of the image stages: the DiT allows the model's own cap of 1000 steps, so a
#: request can run long enough to be cancelled or to outlive its deadline, and offers REQUEST
#: mode (off by default), so that both modes can be compared.
IMAGE_STAGE_OPTIONS: dict[str, dict[str, object]] = {"dit": {"max_steps": 1000,
                                                              "request_mode": True}}
#: How often a bounded wait checks its condition.
POLL_S = 0.02


async def wait_until(condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,
                     what: str = "the condition") -> None:
    """Return as soon as `condition()` holds (it may be async); fail the test if it does not
    within `timeout`."""
    deadline = time.monotonic() + timeout

    async def holds() -> bool:
        value = condition()
        return await value if inspect.isawaitable(value) else value

    while not await holds():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        await asyncio.sleep(POLL_S)


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., object]:
    """The bounded wait above, for tests (synchronise on a condition, never on a sleep)."""
    return wait_until


@dataclass
class RunningStage:
    bundle: StageBundle
    server: RunningServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_model("tiny")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def image_stages(tiny_model_dir: Path) -> AsyncIterator[dict[str, RunningStage]]:
    """The three image stages, shared by a module's tests (each leaves them idle): a module
    using them runs its tests on one event loop (`pytest.mark.asyncio(loop_scope="module")`)."""
    stages = {}
    for name in IMAGE_STAGES:
        bundle = build_stage(name, tiny_model_dir, IMAGE_STAGE_OPTIONS.get(name))
        stages[name] = RunningStage(bundle, await start_stage(bundle))
    yield stages
    for stage in stages.values():
        await stop_stage(stage.bundle, stage.server, grace=0.5)


@pytest.fixture
def make_image_recipe() -> Callable[[dict[str, str], Path], Recipe]:
    """Build a text-to-image recipe for stages at the given addresses."""
    return image_recipe


def image_recipe(addresses: dict[str, str], model_dir: Path) -> Recipe:
    """Request defaults only: every limit comes from what the stages publish."""
    return Recipe(
        name="tiny", task=Task.TEXT_TO_IMAGE, model=str(model_dir),
        stages={name: StageEndpoint(name, address) for name, address in addresses.items()},
        image_defaults=ImageDefaults(width=64, height=64, num_inference_steps=4))


# -- stages on a loop of their own, for property-based suites -------------------------------

#: What runs once the stages serve, given their addresses by name, until `stop` is set.
Then = Callable[[dict[str, str], asyncio.Event, asyncio.Event], Coroutine[None, None, None]]
STAGES_START_TIMEOUT_S = 180.0


async def _until_stopped(addresses: dict[str, str], ready: asyncio.Event,
                         stop: asyncio.Event) -> None:
    ready.set()
    await stop.wait()


class StagesThread:
    """Builds and starts `stages` (name -> (model folder, options)) on a loop in a daemon
    thread; `then` (optional) runs beside them and sets its `ready` event once it serves."""

    def __init__(self, stages: Mapping[str, tuple[Path, Mapping[str, object]]],
                 then: Then | None = None) -> None:
        self._stages = dict(stages)
        self._then = then
        self.addresses: dict[str, str] = {}
        self.bundles: dict[str, StageBundle] = {}
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="test-stages", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(STAGES_START_TIMEOUT_S) or self._failure is not None:
            raise RuntimeError("the stages did not start") from self._failure

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # reported by start()
            self._failure = error
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        servers: dict[str, RunningServer] = {}
        try:
            for name, (model, options) in self._stages.items():
                self.bundles[name] = build_stage(name, model, options)
                servers[name] = await start_stage(self.bundles[name])
                self.addresses[name] = f"127.0.0.1:{servers[name].port}"
            ready = asyncio.Event()
            task = asyncio.create_task((self._then or _until_stopped)(self.addresses, ready,
                                                                      self._stop))
            await asyncio.wait([task, asyncio.create_task(ready.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                await task  # `then` failed before it was ready: report it
            self._ready.set()
            await task
        finally:
            for name, server in servers.items():
                await stop_stage(self.bundles[name], server, grace=0.5)


@pytest.fixture(scope="session")
def make_stages_thread() -> type[StagesThread]:
    """StagesThread, for suites that drive stages from synchronous tests."""
    return StagesThread
