"""Real stage servers on loopback (port 0), in this process, with the tiny seeded model."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.models.qwen_image import ensure_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage

IMAGE_STAGES = ("tokenizer", "dit", "vae")
#: Stage options of the image stages: the DiT allows the model's own cap of 1000 steps, so a
#: request can run long enough to be cancelled or to outlive its deadline.
IMAGE_STAGE_OPTIONS: dict[str, dict[str, object]] = {"dit": {"max_steps": 1000}}
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


@pytest.fixture
async def image_stages(tiny_model_dir: Path) -> AsyncIterator[dict[str, RunningStage]]:
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
