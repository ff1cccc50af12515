"""Real stage servers on loopback (port 0), in this process, with the tiny seeded model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stagemesh.gateway.recipes import ImageDefaults, ImageLimits, Recipe, StageEndpoint, Task
from stagemesh.models.qwen_image import ensure_model, latent_factor
from stagemesh.services.registry import build_stage
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage

IMAGE_STAGES = ("tokenizer", "dit", "vae")


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
        bundle = build_stage(name, tiny_model_dir)
        stages[name] = RunningStage(bundle, await start_stage(bundle))
    yield stages
    for stage in stages.values():
        await stop_stage(stage.bundle, stage.server, grace=0.5)


@pytest.fixture
def make_image_recipe() -> Callable[[dict[str, str], Path], Recipe]:
    """Build a text-to-image recipe for stages at the given addresses."""
    return image_recipe


def image_recipe(addresses: dict[str, str], model_dir: Path) -> Recipe:
    return Recipe(
        name="tiny", task=Task.TEXT_TO_IMAGE, model=str(model_dir),
        stages={name: StageEndpoint(name, address) for name, address in addresses.items()},
        image_defaults=ImageDefaults(width=64, height=64, num_inference_steps=4),
        image_limits=ImageLimits(size_multiple=latent_factor(model_dir)))
