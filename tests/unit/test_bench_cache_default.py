"""`stagemesh bench cache_default`: its recipe and the rule that picks the default threshold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stagemesh.bench.cache_default import RECIPE, RECIPE_YAML, choose
from stagemesh.gateway.recipes import load_recipes

pytestmark = pytest.mark.unit


def arm(threshold: float, seed: int, reused: float, **accuracy: float) -> dict[str, Any]:
    full = {"colour": 1.0, "shape": 0.9, "position": 1.0, "background": 1.0}
    return {"threshold": threshold, "seed": seed, "reused_share": reused,
            "accuracy": {**full, **accuracy}}


def test_the_most_reuse_within_the_tolerance_on_every_seed_wins() -> None:
    arms = [arm(0, 0, 0.0), arm(0, 1, 0.0, shape=0.95),
            arm(0.05, 0, 0.2), arm(0.05, 1, 0.22, shape=0.94),   # 1 point down on seed 1
            arm(0.1, 0, 0.4, shape=0.89), arm(0.1, 1, 0.42, shape=0.92),  # 3 points on seed 1
            arm(0.2, 0, 0.6, colour=0.9), arm(0.2, 1, 0.6)]
    chosen = choose(arms, tolerance=2.0)
    assert chosen["chosen_threshold"] == 0.05
    assert chosen["chosen_reused_share"] == pytest.approx(0.21)
    rows = {row["threshold"]: row for row in chosen["by_threshold"]}
    assert rows[0.1]["drop_points"]["shape"] == pytest.approx(3.0)  # the worst seed counts
    assert not rows[0.1]["within_tolerance"] and not rows[0.2]["within_tolerance"]


def test_cache_off_is_chosen_when_every_threshold_costs_too_much() -> None:
    chosen = choose([arm(0, 0, 0.0), arm(0.05, 0, 0.3, position=0.9)], tolerance=2.0)
    assert (chosen["chosen_threshold"], chosen["chosen_reused_share"]) == (0, 0.0)


def test_the_recipe_caps_the_threshold_at_the_highest_one_measured(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE_YAML.format(name=RECIPE, low=0.05, high=0.2))
    dit = load_recipes(path)[RECIPE].stages["dit"]
    assert dit.options["step_cache"] == "first_block"
    assert dit.options["max_step_cache_threshold"] == 0.2
