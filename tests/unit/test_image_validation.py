"""Image request validation: defaults filled, every bad field named before any stage runs."""

from __future__ import annotations

from typing import Any

import pytest

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images import parse_size, validate_image_params
from stagemesh.gateway.recipes import (
    ImageDefaults,
    ImageLimits,
    Recipe,
    StageEndpoint,
    Task,
)

RECIPE = Recipe(
    name="r", task=Task.TEXT_TO_IMAGE, model="m",
    stages={s: StageEndpoint(s, f"h:{i}") for i, s in enumerate(("tokenizer", "dit", "vae"))},
    image_defaults=ImageDefaults(width=32, height=48, num_inference_steps=7, true_cfg_scale=3.0,
                                 negative_prompt=""),
    image_limits=ImageLimits(max_steps=20, max_n=2, max_pixels=64 * 64, size_multiple=16),
)


def test_defaults_come_from_the_recipe() -> None:
    params = validate_image_params(RECIPE, prompt="a cat", seed=5)
    assert (params.width, params.height, params.num_inference_steps) == (32, 48, 7)
    assert params.true_cfg_scale == 3.0 and params.negative_prompt == "" and params.n == 1
    assert params.seed == 5


def test_a_random_seed_is_chosen_when_none_is_given() -> None:
    seeds = {validate_image_params(RECIPE, prompt="a cat").seed for _ in range(5)}
    assert len(seeds) > 1


@pytest.mark.parametrize(("size", "expected"), [("64x32", (64, 32)), (" 16 X 48 ", (16, 48))])
def test_parse_size(size: str, expected: tuple[int, int]) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["64", "64x", "ax64", "64*64", "-16x16", ""])
def test_unparseable_size_names_the_field(size: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        parse_size(size)
    assert error.value.field_name == "size"


@pytest.mark.parametrize(("overrides", "field"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": "x" * 2001}, "prompt"),
    ({"width": 40}, "size"),  # not a multiple of 16
    ({"height": 8}, "size"),
    ({"width": 128, "height": 128}, "size"),  # above max_pixels
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": 21}, "num_inference_steps"),
    ({"n": 3}, "n"),
    ({"n": 0}, "n"),
    ({"true_cfg_scale": -1.0}, "true_cfg_scale"),
    ({"seed": -1}, "seed"),
])
def test_bad_fields_are_named(overrides: dict[str, Any], field: str) -> None:
    arguments: dict[str, Any] = {"prompt": "a cat", **overrides}
    with pytest.raises(InvalidRequest) as error:
        validate_image_params(RECIPE, **arguments)
    assert error.value.field_name == field
