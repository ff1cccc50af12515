"""Stage options (a recipe's `options:` for one stage): checked at start-up, split per consumer,
and refused with a message naming the stage and the key. No model is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

import pytest

from stagemesh.services.registry import STAGE_BUILDERS, build_stage
from stagemesh.shared.options import EngineOptions, NoOptions, parse_options


class Limits(TypedDict, total=False):
    max_steps: int
    max_true_cfg_scale: float
    default_voice: str
    step_execution: bool


class Optional(TypedDict, total=False):
    voice: str | None


def test_each_group_gets_only_its_keys_and_absent_keys_stay_absent() -> None:
    engine, limits = parse_options(
        "dit", {"max_running": 2, "max_steps": 50}, EngineOptions, Limits)
    assert engine == {"max_running": 2}
    assert limits == {"max_steps": 50}
    assert parse_options("dit", {}, EngineOptions, Limits) == ({}, {})


def test_three_groups() -> None:
    options = {"max_running": 1, "max_steps": 3, "voice": None}
    assert parse_options("x", options, EngineOptions, Limits, Optional) == (
        {"max_running": 1}, {"max_steps": 3}, {"voice": None})


def test_an_int_is_accepted_for_a_float_option_and_becomes_a_float() -> None:
    limits = parse_options("dit", {"max_true_cfg_scale": 20}, Limits)
    assert limits == {"max_true_cfg_scale": 20.0}
    assert type(limits["max_true_cfg_scale"]) is float


def test_an_unknown_key_names_the_stage_the_key_and_the_known_keys() -> None:
    with pytest.raises(ValueError, match=r"stage dit: unknown option 'max_stepz'") as caught:
        parse_options("dit", {"max_stepz": 5}, EngineOptions, Limits)
    assert "'max_running'" in str(caught.value) and "'max_steps'" in str(caught.value)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("max_steps", "200", "int"),
    ("max_steps", 2.5, "int"),
    ("max_steps", True, "int"),  # a bool is not a count
    ("max_true_cfg_scale", "20", "float"),
    ("max_true_cfg_scale", False, "float"),
    ("step_execution", 1, "bool"),
    ("step_execution", "false", "bool"),
    ("default_voice", 3, "str"),
    ("default_voice", None, "str"),
])
def test_a_wrong_type_names_the_stage_the_key_and_the_type(
    key: str, value: object, expected: str
) -> None:
    with pytest.raises(ValueError, match=rf"stage dit: option '{key}' must be {expected}, got"):
        parse_options("dit", {key: value}, Limits)


def test_an_optional_option_takes_null() -> None:
    assert parse_options("talker", {"voice": None}, Optional) == {"voice": None}
    assert parse_options("talker", {"voice": "vivian"}, Optional) == {"voice": "vivian"}
    with pytest.raises(ValueError, match="must be str or null"):
        parse_options("talker", {"voice": 1}, Optional)


def test_a_stage_without_options_refuses_every_key() -> None:
    assert parse_options("vae", {}, NoOptions) == {}
    with pytest.raises(ValueError, match="stage vae: unknown option 'max_running'"):
        parse_options("vae", {"max_running": 1}, NoOptions)


@pytest.mark.parametrize("stage", sorted(STAGE_BUILDERS))
def test_every_stage_checks_its_options_before_loading_its_model(stage: str) -> None:
    # The folder does not exist: only the options check can have raised.
    with pytest.raises(ValueError, match=rf"stage {stage}: unknown option 'bogus'"):
        build_stage(stage, Path("/nonexistent/model"), {"bogus": 1})


def test_an_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        build_stage("nope", Path("/nonexistent/model"))
