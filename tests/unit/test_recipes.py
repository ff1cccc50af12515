"""Recipe files: the default loads, malformed ones fail naming the problem, and the old keys
(`limits:`, `default_voice:`) fail saying where they moved."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.stages import Mesh
from stagemesh.gateway.recipes import (
    DEFAULT_RECIPES,
    TASK_STAGES,
    ImageDefaults,
    RecipeError,
    Task,
    VideoDefaults,
    default_recipe,
    load_recipes,
)
from stagemesh.models.tiny_shapes_edit.evaluate import EDIT_GUIDANCE

K8S_RECIPES = Path(__file__).resolve().parents[2] / "k8s" / "base" / "recipes.yaml"

IMAGE_RECIPE = """
  - name: {name}
    task: text-to-image
    model: /models/x
    stages:
      tokenizer: {{address: "127.0.0.1:1", options: {{max_prompt_chars: 500}}}}
      dit: {{address: "127.0.0.1:2", options: {{step_execution: false, max_steps: 50}}}}
      vae: {{address: "127.0.0.1:3", metrics_port: 9000}}
    defaults: {{width: 32, num_inference_steps: 8, true_cfg_scale: 2}}
"""

SPEECH_RECIPE = """
  - name: speech
    task: text-to-speech
    model: /models/s
    stages:
      talker: {address: "127.0.0.1:4", options: {default_voice: ryan, max_new_frames: 100}}
      codec: {address: "127.0.0.1:5"}
"""


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipes.yaml"
    path.write_text(body)
    return path


@pytest.mark.parametrize("path", [DEFAULT_RECIPES, K8S_RECIPES])
def test_shipped_recipes_load_with_every_stage_of_their_task(path: Path) -> None:
    recipes = load_recipes(path)
    image = next(r for r in recipes.values() if r.task is Task.TEXT_TO_IMAGE)
    assert set(image.stages) == {"tokenizer", "dit", "vae"}
    assert image.stage("dit").options["step_execution"] is True
    speech = next(r for r in recipes.values() if r.task is Task.TEXT_TO_SPEECH)
    assert set(speech.stages) == {"talker", "codec"}


def test_the_default_mesh_keeps_its_limits_as_stage_options() -> None:
    recipes = load_recipes(DEFAULT_RECIPES)
    image, speech = recipes["tiny-shapes"], recipes["csm-tiny"]
    assert image.stage("dit").options == {"step_execution": True, "max_steps": 200,
                                          "max_pixels": 262144, "max_images_per_request": 4,
                                          "preview_painter": "decoder"}
    assert image.stage("tokenizer").options == {"max_prompt_chars": 2000}
    assert image.image_defaults == ImageDefaults(width=32, height=32, num_inference_steps=16,
                                                 true_cfg_scale=4.0, negative_prompt="")
    assert speech.stage("talker").options["default_voice"] == "vivian"
    assert speech.stage("talker").options["max_new_frames"] == 750


def test_the_default_edit_recipe_answers_a_small_image_when_no_size_is_named() -> None:
    """Without these defaults an edit takes the stock derived size (~1 Mpx, ~8 s an image on a
    CPU): `make serve` answers a first edit quickly at the size tiny-shapes-edit was trained
    at, with the steps and guidance it was evaluated with (a light true CFG: its negative, "", is
    trained as "change nothing"; guidance 4 over-shoots recolours, e.g. red + "make it blue"
    -> green)."""
    edit = load_recipes(DEFAULT_RECIPES)["tiny-shapes-edit"]
    assert edit.task is Task.IMAGE_EDIT
    assert edit.image_defaults == ImageDefaults(width=32, height=32, num_inference_steps=16,
                                                true_cfg_scale=EDIT_GUIDANCE, negative_prompt="")


def test_fields_are_read(tmp_path: Path) -> None:
    recipes = load_recipes(write(tmp_path, "recipes:" + IMAGE_RECIPE.format(name="a")
                                 + SPEECH_RECIPE))
    recipe = recipes["a"]
    assert recipe.stage("dit").options == {"step_execution": False, "max_steps": 50}
    assert recipe.stage("tokenizer").options == {"max_prompt_chars": 500}
    assert recipe.stage("vae").metrics_url == "http://127.0.0.1:9000/metrics"
    assert recipe.stage("vae").options == {}
    assert recipe.stage("tokenizer").port == 1 and recipe.stage("tokenizer").host == "127.0.0.1"
    # defaults: given keys are read (an int becomes a float scale), the others keep theirs
    assert recipe.image_defaults == ImageDefaults(width=32, height=64, num_inference_steps=8,
                                                  true_cfg_scale=2.0, negative_prompt="")
    assert recipes["speech"].stage("talker").options == {"default_voice": "ryan",
                                                         "max_new_frames": 100}


@pytest.mark.parametrize(("body", "match"), [
    ("recipes: []", "non-empty"),
    ("recipes:" + IMAGE_RECIPE.format(name="a") + IMAGE_RECIPE.format(name="a"), "twice"),
    ("recipes:\n  - {name: x, task: painting, model: m, stages: {}}", "unknown task"),
    ("recipes:\n  - {name: x, task: text-to-image, model: m, stages: {dit: {address: 'h:1'}}}",
     "needs stages"),
    ("recipes:\n  - {task: text-to-image, model: m, stages: {}}", "missing key 'name'"),
    ("recipes:" + IMAGE_RECIPE.format(name="a").replace("num_inference_steps",
                                                         "num_inference_stepz"),
     "num_inference_stepz"),
    ("recipes:" + IMAGE_RECIPE.format(name="a").replace("width: 32", "width: big"),
     "defaults.width: expected an integer"),
    ("recipes:" + IMAGE_RECIPE.format(name="a").replace("max_steps: 50", "max_steps: [50]"),
     r"stages.dit.options.max_steps: expected a number, string or boolean"),
    ("recipes:" + IMAGE_RECIPE.format(name="a").replace("metrics_port: 9000", "metrix: 9000"),
     r"stages.vae: unknown keys \['metrix'\]"),
    ("recipes:" + IMAGE_RECIPE.format(name="a") + "    colour: red\n",
     r"unknown keys \['colour'\]"),
    ("recipes:" + SPEECH_RECIPE + "    defaults: {width: 32}\n", "text-to-image recipes"),
])
def test_malformed_recipes_fail_naming_the_problem(tmp_path: Path, body: str, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        load_recipes(write(tmp_path, body))


@pytest.mark.parametrize(("limits", "moved"), [
    ("{max_steps: 50}", "max_steps -> stages.dit.options.max_steps"),
    ("{max_n: 2}", "max_n -> stages.dit.options.max_images_per_request"),
    ("{max_pixels: 4096}", "max_pixels -> stages.dit.options.max_pixels"),
    ("{max_prompt_chars: 9}", "max_prompt_chars -> stages.tokenizer.options.max_prompt_chars"),
    ("{size_multiple: 8}", "size_multiple -> remove it"),
    ("{max_input_chars: 9}", "max_input_chars -> stages.talker.options.max_input_chars"),
    ("{max_new_frames: 9}", "max_new_frames -> stages.talker.options.max_new_frames"),
    ("{max_ref_audio_bytes: 9}", "max_ref_audio_bytes -> remove it"),
])
def test_the_old_limits_block_fails_saying_where_each_key_moved(
    tmp_path: Path, limits: str, moved: str,
) -> None:
    body = "recipes:" + IMAGE_RECIPE.format(name="a") + f"    limits: {limits}\n"
    with pytest.raises(RecipeError, match="`limits:` is gone") as error:
        load_recipes(write(tmp_path, body))
    assert moved in str(error.value) and "recipes[0]" in str(error.value)


def test_the_old_default_voice_key_fails_saying_where_it_moved(tmp_path: Path) -> None:
    body = "recipes:" + SPEECH_RECIPE + "    default_voice: vivian\n"
    with pytest.raises(RecipeError, match=r"stages\.talker\.options\.default_voice"):
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
    with pytest.raises(InvalidRequest, match="no recipe serves text-to-speech"):
        mesh.recipe("", Task.TEXT_TO_SPEECH)


def _tokenizer_dit_vae_recipe(name: str, task: str, defaults: str = "") -> str:
    return f"""
  - name: {name}
    task: {task}
    model: /models/{name}
    stages:
      tokenizer: {{address: "127.0.0.1:1"}}
      dit: {{address: "127.0.0.1:2"}}
      vae: {{address: "127.0.0.1:3"}}
""" + (f"    defaults: {defaults}\n" if defaults else "")


def test_edit_and_video_recipes_run_on_the_tokenizer_dit_and_vae(tmp_path: Path) -> None:
    recipes = load_recipes(write(tmp_path, "recipes:" + "".join(
        _tokenizer_dit_vae_recipe(task, task)
        for task in ("image-edit", "text-to-video", "image-to-video"))))
    for task in (Task.IMAGE_EDIT, Task.TEXT_TO_VIDEO, Task.IMAGE_TO_VIDEO):
        assert TASK_STAGES[task] == ("tokenizer", "dit", "vae")
        recipe = default_recipe(recipes, task)
        assert recipe is not None and recipe.task is task
    # an edit recipe's size is derived from the input image unless its file sets one
    assert recipes["image-edit"].image_defaults == ImageDefaults(width=0, height=0)
    assert recipes["text-to-video"].video_defaults == VideoDefaults()
    mesh = Mesh(recipes)
    with pytest.raises(InvalidRequest, match="serves image-edit, not text-to-video") as error:
        mesh.recipe("image-edit", Task.TEXT_TO_VIDEO)
    assert error.value.field_name == "model"


def test_edit_and_video_defaults_are_read_typed(tmp_path: Path) -> None:
    recipes = load_recipes(write(tmp_path, "recipes:" + _tokenizer_dit_vae_recipe(
        "edit", "image-edit", "{num_inference_steps: 4, true_cfg_scale: 2, negative_prompt: ' '}"
    ) + _tokenizer_dit_vae_recipe(
        "video", "image-to-video", "{width: 96, height: 48, num_frames: 17, fps: 16, "
        "num_inference_steps: 3, guidance_scale: 5, negative_prompt: blurry, flow_shift: 3}"
    ) + _tokenizer_dit_vae_recipe("plain", "text-to-video", "{fps: 24}")))
    assert recipes["edit"].image_defaults == ImageDefaults(
        width=0, height=0, num_inference_steps=4, true_cfg_scale=2.0, negative_prompt=" ")
    assert recipes["video"].video_defaults == VideoDefaults(
        width=96, height=48, num_frames=17, fps=16, num_inference_steps=3, guidance_scale=5.0,
        negative_prompt="blurry", flow_shift=3.0)
    assert recipes["plain"].video_defaults == VideoDefaults(fps=24)
    assert recipes["plain"].video_defaults.flow_shift is None  # the model's own shift


@pytest.mark.parametrize(("task", "defaults", "match"), [
    ("image-edit", "{width: 64}", "both width and height or neither"),
    ("image-edit", "{num_frames: 9}", r"unknown keys \['num_frames'\]"),
    ("text-to-video", "{true_cfg_scale: 4}", r"unknown keys \['true_cfg_scale'\]"),
    ("text-to-video", "{num_frames: nine}", "defaults.num_frames: expected an integer"),
    ("image-to-video", "{flow_shift: fast}", "defaults.flow_shift: expected a number"),
    ("image-to-video", "{guidance_scale: null}", "defaults.guidance_scale: expected a number"),
])
def test_malformed_edit_and_video_defaults_fail_naming_the_key(
    tmp_path: Path, task: str, defaults: str, match: str,
) -> None:
    with pytest.raises(RecipeError, match=match):
        load_recipes(write(tmp_path, "recipes:" + _tokenizer_dit_vae_recipe("r", task, defaults)))
