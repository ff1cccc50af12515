"""Recipes: which stages serve a model, where they run, their options, and request defaults.

A recipe file is YAML with a list of recipes; the request's `model` field picks one by name.
See gateway/recipes/default.yaml for the embedded default. Limits are not a recipe's business:
each stage owns its limits (its `options`, never looser than its model allows) and publishes
the effective values through its Describe RPC, which is what the gateway enforces.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

DEFAULT_RECIPES = Path(__file__).parent / "recipes" / "default.yaml"

#: A stage option's value (options are passed to the stage process as JSON).
OptionValue = bool | int | float | str


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

#: Where each key of the old `limits:` block went (None: the stage reads it from its model).
MOVED_LIMITS: dict[str, str | None] = {
    "max_prompt_chars": "stages.tokenizer.options.max_prompt_chars",
    "max_steps": "stages.dit.options.max_steps",
    "max_n": "stages.dit.options.max_images_per_request",
    "max_pixels": "stages.dit.options.max_pixels",
    "size_multiple": None,
    "max_input_chars": "stages.talker.options.max_input_chars",
    "max_new_frames": "stages.talker.options.max_new_frames",
    "max_ref_audio_bytes": None,
}

_RECIPE_KEYS = frozenset({"name", "task", "model", "stages", "defaults"})
_ENDPOINT_KEYS = frozenset({"address", "metrics_port", "options"})


@dataclass(frozen=True)
class StageEndpoint:
    """One stage service of a recipe."""

    name: str  # "tokenizer", "dit", ...
    address: str  # host:port of its gRPC server
    metrics_port: int | None = None  # where it serves /metrics over HTTP
    #: The stage's options (operator policy, e.g. step_execution, max_steps): handed to the
    #: stage process by `stagemesh serve`; the stage validates them and publishes the result.
    options: dict[str, OptionValue] = field(default_factory=dict)

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
    """What an image request gets for each field it leaves out."""

    width: int = 64
    height: int = 64
    num_inference_steps: int = 10
    true_cfg_scale: float = 4.0
    negative_prompt: str | None = ""  # "" (not None) turns guidance on, as in diffusers


@dataclass(frozen=True)
class Recipe:
    name: str
    task: Task
    model: str  # model folder, or "builtin:<name>" for an embedded default
    stages: dict[str, StageEndpoint]
    image_defaults: ImageDefaults = ImageDefaults()

    def stage(self, name: str) -> StageEndpoint:
        return self.stages[name]


def _moved_limits_message(where: str, limits: object) -> str:
    keys = list(limits) if isinstance(limits, Mapping) else []
    moves = [f"{key} -> {MOVED_LIMITS[key] or 'remove it (the stages publish it from the model)'}"
             for key in keys if key in MOVED_LIMITS]
    return (f"{where}: `limits:` is gone; each limit is now an option of the stage it limits"
            + (f" ({'; '.join(moves)})" if moves else ""))


def _check_keys(entry: Mapping[str, object], where: str) -> None:
    """Refuse keys this file format does not have, saying where the old ones moved."""
    if "limits" in entry:
        raise RecipeError(_moved_limits_message(where, entry["limits"]))
    if "default_voice" in entry:
        raise RecipeError(f"{where}: `default_voice:` moved to "
                          "stages.talker.options.default_voice")
    unknown = sorted(set(entry) - _RECIPE_KEYS)
    if unknown:
        raise RecipeError(f"{where}: unknown keys {unknown}; expected {sorted(_RECIPE_KEYS)}")


def _options(raw: object, where: str) -> dict[str, OptionValue]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where}.options must be a mapping of option names to values")
    options: dict[str, OptionValue] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not isinstance(value, bool | int | float | str):
            raise RecipeError(f"{where}.options.{key}: expected a number, string or boolean, "
                              f"got {value!r}")
        options[key] = value
    return options


def _endpoint(stage: str, raw: object, where: str) -> StageEndpoint:
    where = f"{where}.stages.{stage}"
    if not isinstance(raw, Mapping) or "address" not in raw:
        raise RecipeError(f"{where}: expected a mapping with an `address`")
    unknown = sorted(set(raw) - _ENDPOINT_KEYS)
    if unknown:
        raise RecipeError(f"{where}: unknown keys {unknown}; expected {sorted(_ENDPOINT_KEYS)}")
    metrics_port = raw.get("metrics_port")
    if metrics_port is not None and (isinstance(metrics_port, bool)
                                     or not isinstance(metrics_port, int)):
        raise RecipeError(f"{where}.metrics_port must be an integer, got {metrics_port!r}")
    return StageEndpoint(name=stage, address=str(raw["address"]), metrics_port=metrics_port,
                         options=_options(raw.get("options"), where))


class _DefaultsReader:
    """Typed reads of a `defaults:` mapping: a missing key keeps ImageDefaults' value."""

    def __init__(self, raw: Mapping[str, object], where: str) -> None:
        self.raw, self.where, self.base = raw, f"{where}.defaults", ImageDefaults()

    def integer(self, name: str) -> int:
        value = self.raw.get(name, getattr(self.base, name))
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{self.where}.{name}: expected an integer, got {value!r}")
        return value

    def number(self, name: str) -> float:
        value = self.raw.get(name, getattr(self.base, name))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecipeError(f"{self.where}.{name}: expected a number, got {value!r}")
        return float(value)

    def text(self, name: str) -> str | None:
        value = self.raw.get(name, getattr(self.base, name))
        if value is not None and not isinstance(value, str):
            raise RecipeError(f"{self.where}.{name}: expected a string or null, got {value!r}")
        return value


def _image_defaults(raw: object, task: Task, where: str) -> ImageDefaults:
    if raw is None:
        return ImageDefaults()
    if task is not Task.TEXT_TO_IMAGE:
        raise RecipeError(f"{where}: `defaults:` are request defaults of text-to-image recipes")
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where}.defaults must be a mapping")
    known = sorted(f.name for f in fields(ImageDefaults))
    unknown = sorted(str(key) for key in set(raw) - set(known))
    if unknown:
        raise RecipeError(f"{where}.defaults: unknown keys {unknown}; expected {known}")
    read = _DefaultsReader(raw, where)
    return ImageDefaults(width=read.integer("width"), height=read.integer("height"),
                         num_inference_steps=read.integer("num_inference_steps"),
                         true_cfg_scale=read.number("true_cfg_scale"),
                         negative_prompt=read.text("negative_prompt"))


def _build(entry: object, where: str) -> Recipe:
    if not isinstance(entry, Mapping):
        raise RecipeError(f"{where}: expected a mapping")
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
    where = f"{where} ({name!r})"
    _check_keys(entry, where)
    if not isinstance(raw_stages, Mapping):
        raise RecipeError(f"{where}.stages must be a mapping of stage names")
    needed = TASK_STAGES[task]
    absent = [s for s in needed if s not in raw_stages]
    if absent:
        raise RecipeError(f"recipe {name!r}: task {task.value} needs stages {absent}")
    extra = sorted(set(raw_stages) - set(needed))
    if extra:
        raise RecipeError(f"{where}: task {task.value} has no stages {extra}")
    stages = {stage: _endpoint(stage, raw_stages[stage], where) for stage in needed}
    return Recipe(name=name, task=task, model=model, stages=stages,
                  image_defaults=_image_defaults(entry.get("defaults"), task, where))


def load_recipes(path: Path | str = DEFAULT_RECIPES) -> dict[str, Recipe]:
    """Load and validate a recipe file; names must be unique."""
    document = yaml.safe_load(Path(path).read_text())
    entries = document.get("recipes") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise RecipeError(f"{path}: expected a non-empty `recipes:` list")
    recipes: dict[str, Recipe] = {}
    for index, entry in enumerate(entries):
        recipe = _build(entry, f"{path}: recipes[{index}]")
        if recipe.name in recipes:
            raise RecipeError(f"{path}: recipe name {recipe.name!r} appears twice")
        recipes[recipe.name] = recipe
    return recipes


def default_recipe(recipes: Mapping[str, Recipe], task: Task) -> Recipe | None:
    """The first recipe of a task: what an empty `model` field selects."""
    return next((r for r in recipes.values() if r.task is task), None)
