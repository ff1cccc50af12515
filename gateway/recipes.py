"""Recipes: which stages serve a model, where they run, and the request defaults and limits.

A recipe file is YAML with a list of recipes; the request's `model` field picks one by name.
See gateway/recipes/default.yaml for the embedded default.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_RECIPES = Path(__file__).parent / "recipes" / "default.yaml"


class RecipeError(ValueError):
    """A recipe file is malformed; the message names the recipe and key."""


class Task(enum.StrEnum):
    TEXT_TO_IMAGE = "text-to-image"
    TEXT_TO_SPEECH = "text-to-speech"


#: Stages each task needs, in the order a request travels through them.
TASK_STAGES: dict[Task, tuple[str, ...]] = {
    Task.TEXT_TO_IMAGE: ("tokenizer", "dit", "vae"),
    Task.TEXT_TO_SPEECH: ("talker", "codec"),
}


@dataclass(frozen=True)
class StageEndpoint:
    """One stage service of a recipe."""

    name: str  # "tokenizer", "dit", ...
    address: str  # host:port of its gRPC server
    metrics_port: int | None = None  # where it serves /metrics over HTTP
    options: dict[str, Any] = field(default_factory=dict)  # stage flags, e.g. step_execution

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else ""


@dataclass(frozen=True)
class ImageDefaults:
    width: int = 64
    height: int = 64
    num_inference_steps: int = 10
    true_cfg_scale: float = 4.0
    negative_prompt: str | None = ""  # "" (not None) turns guidance on, as in diffusers


@dataclass(frozen=True)
class ImageLimits:
    max_steps: int = 200
    max_n: int = 4
    max_pixels: int = 1024 * 1024
    size_multiple: int = 16  # the model's latent factor: width and height must be multiples
    max_prompt_chars: int = 2000


@dataclass(frozen=True)
class SpeechLimits:
    max_input_chars: int = 2000
    max_ref_audio_bytes: int = 10 * 1024 * 1024
    max_new_frames: int = 750  # 60 s at 12.5 frames/s


@dataclass(frozen=True)
class Recipe:
    name: str
    task: Task
    model: str  # model folder, or "builtin:<name>" for an embedded default
    stages: dict[str, StageEndpoint]
    image_defaults: ImageDefaults = ImageDefaults()
    image_limits: ImageLimits = ImageLimits()
    speech_limits: SpeechLimits = SpeechLimits()
    default_voice: str = ""

    def stage(self, name: str) -> StageEndpoint:
        return self.stages[name]


def _build(entry: dict[str, Any], where: str) -> Recipe:
    try:
        name = str(entry["name"])
        task = Task(entry["task"])
        model = str(entry["model"])
        raw_stages = entry["stages"]
    except KeyError as missing:
        raise RecipeError(f"{where}: missing key {missing}") from None
    except ValueError:
        raise RecipeError(f"{where}: unknown task {entry.get('task')!r}; "
                          f"expected one of {[t.value for t in Task]}") from None
    needed = TASK_STAGES[task]
    absent = [s for s in needed if s not in raw_stages]
    if absent:
        raise RecipeError(f"recipe {name!r}: task {task.value} needs stages {absent}")
    stages = {
        stage: StageEndpoint(name=stage, address=str(raw_stages[stage]["address"]),
                             metrics_port=raw_stages[stage].get("metrics_port"),
                             options=dict(raw_stages[stage].get("options") or {}))
        for stage in needed
    }
    try:
        return Recipe(
            name=name, task=task, model=model, stages=stages,
            image_defaults=ImageDefaults(**(entry.get("defaults") or {}))
            if task is Task.TEXT_TO_IMAGE else ImageDefaults(),
            image_limits=ImageLimits(**(entry.get("limits") or {}))
            if task is Task.TEXT_TO_IMAGE else ImageLimits(),
            speech_limits=SpeechLimits(**(entry.get("limits") or {}))
            if task is Task.TEXT_TO_SPEECH else SpeechLimits(),
            default_voice=str(entry.get("default_voice", "")),
        )
    except TypeError as error:
        raise RecipeError(f"recipe {name!r}: {error}") from None


def load_recipes(path: Path | str = DEFAULT_RECIPES) -> dict[str, Recipe]:
    """Load and validate a recipe file; names must be unique."""
    document = yaml.safe_load(Path(path).read_text())
    entries = (document or {}).get("recipes")
    if not isinstance(entries, list) or not entries:
        raise RecipeError(f"{path}: expected a non-empty `recipes:` list")
    recipes: dict[str, Recipe] = {}
    for index, entry in enumerate(entries):
        recipe = _build(entry, f"{path}: recipes[{index}]")
        if recipe.name in recipes:
            raise RecipeError(f"{path}: recipe name {recipe.name!r} appears twice")
        recipes[recipe.name] = recipe
    return recipes


def default_recipe(recipes: dict[str, Recipe], task: Task) -> Recipe | None:
    """The first recipe of a task: what an empty `model` field selects."""
    return next((r for r in recipes.values() if r.task is task), None)
