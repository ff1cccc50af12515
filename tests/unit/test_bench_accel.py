"""`stagemesh bench accel`: its recipes (one DiT per method, nothing shared) and its report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stagemesh.bench.accel import MESH_ARMS, Cell, Options, parse, recipes_yaml, report
from stagemesh.gateway.recipes import load_recipes

pytestmark = pytest.mark.unit


def test_each_method_gets_its_own_dit_with_the_same_setting(tmp_path: Path) -> None:
    options = parse(["--threshold", "0.3", "--as-diffusers", "--model", "builtin:tiny-shapes"])
    path = tmp_path / "recipes.yaml"
    path.write_text(recipes_yaml(options))
    recipes = load_recipes(path)
    assert sorted(recipes) == sorted(MESH_ARMS)
    dits = [recipe.stages["dit"] for recipe in recipes.values()]
    assert len({dit.address for dit in dits}) == 3  # one address would be one shared stage
    for name, dit in zip(recipes, dits, strict=True):
        assert dit.options["step_cache"] == MESH_ARMS[name].value
        assert dit.options["step_cache_threshold"] == 0.3
        assert dit.options["step_cache_warmup_steps"] == dit.options["step_cache_max_skips"] == 0


def test_the_report_compares_each_arm_with_its_twin_without_a_cache() -> None:
    options = Options(model="builtin:qwen-image-bench", size=64, steps=4, concurrency=(1,),
                      rounds=1, cache=parse([]).cache, out=Path("unused"))
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    off = Cell([1.0], [1.0], {"full": 8.0, "reused": 0.0}, {0: image})
    cached = Cell([0.5], [2.0], {"full": 6.0, "reused": 2.0}, {0: image + 1})
    result = report(options, {("mesh-off", 1): off, ("mesh-first_block", 1): cached})
    rows = {row["arm"]: row for row in result["results"]}
    assert rows["mesh-first_block"]["reused_share"] == pytest.approx(0.25)
    assert rows["mesh-first_block"]["psnr_vs_off"] == pytest.approx(48.13, abs=0.01)
    assert "psnr_vs_off" not in rows["mesh-off"]
