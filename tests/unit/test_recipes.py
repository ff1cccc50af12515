"""Recipe files: the default loads, and malformed ones fail naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh import Mesh
from stagemesh.gateway.recipes import (
    DEFAULT_RECIPES,
    RecipeError,
    Task,
    load_recipes,
)

IMAGE_RECIPE = """
  - name: {name}
    task: text-to-image
    model: /models/x
    stages:
      tokenizer: {{address: "127.0.0.1:1"}}
      dit: {{address: "127.0.0.1:2", options: {{step_execution: false}}}}
      vae: {{address: "127.0.0.1:3", metrics_port: 9000}}
    limits: {{max_steps: 50}}
"""


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipes.yaml"
    path.write_text(body)
    return path


def test_default_recipes_load_with_every_stage_of_their_task() -> None:
    recipes = load_recipes(DEFAULT_RECIPES)
    image = next(r for r in recipes.values() if r.task is Task.TEXT_TO_IMAGE)
    assert set(image.stages) == {"tokenizer", "dit", "vae"}
    assert image.stage("dit").options["step_execution"] is True


def test_fields_are_read(tmp_path: Path) -> None:
    recipes = load_recipes(write(tmp_path, "recipes:" + IMAGE_RECIPE.format(name="a")))
    recipe = recipes["a"]
    assert recipe.image_limits.max_steps == 50
    assert recipe.stage("dit").options == {"step_execution": False}
    assert recipe.stage("vae").metrics_url == "http://127.0.0.1:9000/metrics"
    assert recipe.stage("tokenizer").port == 1


@pytest.mark.parametrize(("body", "match"), [
    ("recipes: []", "non-empty"),
    ("recipes:" + IMAGE_RECIPE.format(name="a") + IMAGE_RECIPE.format(name="a"), "twice"),
    ("recipes:\n  - {name: x, task: painting, model: m, stages: {}}", "unknown task"),
    ("recipes:\n  - {name: x, task: text-to-image, model: m, stages: {dit: {address: 'h:1'}}}",
     "needs stages"),
    ("recipes:\n  - {task: text-to-image, model: m, stages: {}}", "missing key 'name'"),
    ("recipes:" + IMAGE_RECIPE.format(name="a").replace("max_steps", "max_stepz"), "max_stepz"),
])
def test_malformed_recipes_fail_naming_the_problem(tmp_path: Path, body: str, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        load_recipes(write(tmp_path, body))


def test_model_field_selects_the_recipe(tmp_path: Path) -> None:
    recipes = load_recipes(write(tmp_path, "recipes:" + IMAGE_RECIPE.format(name="a")
                                 + IMAGE_RECIPE.format(name="b")))
    mesh = Mesh(recipes)
    assert mesh.recipe("b", Task.TEXT_TO_IMAGE).name == "b"
    assert mesh.recipe("", Task.TEXT_TO_IMAGE).name == "a"  # empty = first of the task
    with pytest.raises(InvalidRequest, match="unknown model 'c'") as error:
        mesh.recipe("c", Task.TEXT_TO_IMAGE)
    assert error.value.field_name == "model"
    with pytest.raises(InvalidRequest, match="serves text-to-image"):
        mesh.recipe("a", Task.TEXT_TO_SPEECH)
