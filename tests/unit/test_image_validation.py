"""Image request validation: defaults filled from the recipe, every field checked against what
the stages publish (ImageFacts), every bad field named before any stage runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.protocol import (
    ImageParams,
    ImageRequest,
    parse_size,
    resolve_image_request,
)
from stagemesh.gateway.mesh.stages import ImageFacts
from stagemesh.gateway.recipes import ImageDefaults
from stagemesh.shared.limits import MAX_SEED
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)

DEFAULTS = ImageDefaults(width=32, height=48, num_inference_steps=7, true_cfg_scale=3.0,
                         negative_prompt="")
FACTS = ImageFacts(max_prompt_chars=2000, size_multiple=16, max_side=96, max_pixels=64 * 64,
                   max_steps=20, max_true_cfg_scale=20.0, max_images_per_request=2,
                   min_steps=2,
                   execution_modes=(common_pb2.EXECUTION_MODE_STEP,
                                    common_pb2.EXECUTION_MODE_REQUEST))


def resolve(**fields: object) -> ImageParams:
    return resolve_image_request(replace(ImageRequest(prompt="a cat"), **fields), DEFAULTS, FACTS)


def test_defaults_come_from_the_recipe() -> None:
    params = resolve_image_request(ImageRequest(prompt="a cat", seed=5), DEFAULTS, FACTS)
    assert (params.width, params.height, params.num_inference_steps) == (32, 48, 7)
    assert params.true_cfg_scale == 3.0 and params.negative_prompt == "" and params.n == 1
    assert params.seed == 5
    assert params.execution_mode == common_pb2.EXECUTION_MODE_UNSPECIFIED
    assert params.priority == 0


def test_given_fields_win_over_the_defaults() -> None:
    params = resolve_image_request(ImageRequest(
        prompt="a cat", negative_prompt="dogs", n=2, width=64, height=16,
        num_inference_steps=20, true_cfg_scale=20.0, seed=MAX_SEED - 2,
        execution_mode=common_pb2.EXECUTION_MODE_REQUEST, priority=-1000), DEFAULTS, FACTS)
    assert (params.negative_prompt, params.n, params.width, params.height) == ("dogs", 2, 64, 16)
    assert (params.num_inference_steps, params.true_cfg_scale) == (20, 20.0)
    assert params.seed == MAX_SEED - 2
    assert params.execution_mode == common_pb2.EXECUTION_MODE_REQUEST
    assert params.priority == -1000


def test_a_random_seed_is_chosen_when_none_is_given() -> None:
    seeds = {resolve_image_request(ImageRequest(prompt="a cat"), DEFAULTS, FACTS).seed
             for _ in range(5)}
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
    ({"prompt": "x" * 2001}, "prompt"),  # above the tokenizer's max_prompt_chars
    ({"negative_prompt": "x" * 2001}, "negative_prompt"),
    ({"width": 40}, "size"),  # not a multiple of 16
    ({"height": 8}, "size"),
    ({"width": 128, "height": 16}, "size"),  # above max_side
    ({"width": 80, "height": 80}, "size"),  # above max_pixels
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": 21}, "num_inference_steps"),  # above the DiT's max_steps
    ({"n": 3}, "n"),  # above max_images_per_request
    ({"n": 0}, "n"),
    ({"true_cfg_scale": -1.0}, "true_cfg_scale"),
    ({"true_cfg_scale": 20.5}, "true_cfg_scale"),  # above the DiT's max_true_cfg_scale
    ({"seed": -1}, "seed"),
    ({"seed": MAX_SEED, "n": 2}, "seed"),  # the second image's seed would overflow int64
    ({"priority": 1001}, "priority"),
    ({"priority": -1001}, "priority"),
])
def test_bad_fields_are_named(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        resolve(**overrides)
    assert error.value.field_name == field


def test_the_priority_refusal_states_the_range() -> None:
    with pytest.raises(InvalidRequest, match=r"between -1000 and 1000 \(lower runs sooner\)"):
        resolve(priority=5000)
    assert resolve(priority=1000).priority == 1000


def test_the_size_refusal_states_the_published_multiple() -> None:
    with pytest.raises(InvalidRequest, match="multiple of 16 for this model, got 40"):
        resolve(width=40)


def test_an_execution_mode_the_dit_does_not_offer_is_refused() -> None:
    step_only = replace(FACTS, execution_modes=(common_pb2.EXECUTION_MODE_STEP,))
    request = ImageRequest(prompt="a cat", execution_mode=common_pb2.EXECUTION_MODE_REQUEST)
    with pytest.raises(InvalidRequest, match=r"\['step'\]") as error:
        resolve_image_request(request, DEFAULTS, step_only)
    assert error.value.field_name == "execution_mode"


def test_facts_combine_what_each_stage_publishes() -> None:
    facts = ImageFacts.published(
        tokenizer_service_pb2.DescribeTokenizerResponse(max_prompt_chars=100),
        dit_service_pb2.DescribeDitResponse(
            size_multiple=16, max_side=2048, max_pixels=1 << 20, max_steps=50,
            max_true_cfg_scale=7.5, max_images_per_request=3, min_steps=2,
            execution_modes=[common_pb2.EXECUTION_MODE_REQUEST, common_pb2.EXECUTION_MODE_STEP]),
        vae_service_pb2.DescribeVaeResponse(size_multiple=8, max_side=1024))
    assert facts == ImageFacts(max_prompt_chars=100, size_multiple=16, max_side=1024,
                               max_pixels=1 << 20, max_steps=50, max_true_cfg_scale=7.5,
                               max_images_per_request=3, min_steps=2,
                               execution_modes=(common_pb2.EXECUTION_MODE_REQUEST,
                                                common_pb2.EXECUTION_MODE_STEP))


def test_steps_below_the_published_minimum_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequest, match="between 2 and 20, got 1") as error:
        resolve(num_inference_steps=1)
    assert error.value.field_name == "num_inference_steps"
    assert resolve(num_inference_steps=2).num_inference_steps == 2
