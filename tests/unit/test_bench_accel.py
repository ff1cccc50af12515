"""`stagemesh bench accel`: its recipes (one DiT per method, nothing shared) and its report;
the quantization/compile arms' recipes, through a dry run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stagemesh.bench.accel import (
    EXACT,
    MESH_ARMS,
    PEER,
    QUANT_ARMS,
    Cell,
    Options,
    main,
    parse,
    recipes_yaml,
    report,
)
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


def test_a_dry_run_writes_the_quant_arms_recipes_and_plan_and_runs_nothing(
    tmp_path: Path,
) -> None:
    """`--suite quant --dry-run`: stock diffusers and the exact mesh path beside int8, compile
    and both, each its own DiT (int8 on its tokenizer too), each compared with the exact one."""
    main(["--suite", "quant", "--dry-run", "--model", "builtin:tiny-shapes", "--size", "32",
          "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "recipes.yaml"]
    recipes = load_recipes(tmp_path / "recipes.yaml")
    assert list(recipes) == [EXACT, *QUANT_ARMS]
    assert len({recipe.stages["dit"].address for recipe in recipes.values()}) == len(recipes)
    settings = {name: (recipe.stages["dit"].options["quantization"],
                       recipe.stages["dit"].options["compile"],
                       recipe.stages["tokenizer"].options["quantization"],
                       recipe.stages["dit"].options["step_cache"])
                for name, recipe in recipes.items()}
    assert settings == {EXACT: ("none", "off", "none", "off"),
                        "mesh-int8": ("int8", "off", "int8", "off"),
                        "mesh-compile": ("none", "blocks", "none", "off"),
                        "mesh-int8-compile": ("int8", "blocks", "int8", "off")}
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["arms"] == [PEER, EXACT, *QUANT_ARMS]
    assert plan["twins"] == dict.fromkeys(QUANT_ARMS, EXACT)


def test_recompiles_after_warm_up_are_reported_per_mesh_arm() -> None:
    options = Options(model="builtin:qwen-image-bench", size=64, steps=4, concurrency=(1,),
                      rounds=1, cache=parse([]).cache, out=Path("unused"),
                      arms=parse(["--suite", "quant"]).arms)
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    exact = Cell([1.0], [1.0], {"full": 8.0, "reused": 0.0}, {0: image})
    compiled = Cell([0.5], [2.0], {"full": 8.0, "reused": 0.0}, {0: image}, recompiles=2.0)
    result = report(options, {(EXACT, 1): exact, ("mesh-compile", 1): compiled})
    rows = {row["arm"]: row for row in result["results"]}
    assert (rows[EXACT]["recompiles"], rows["mesh-compile"]["recompiles"]) == (0.0, 2.0)
    assert rows["mesh-compile"]["psnr_vs_off"] == float("inf")  # the same image
    assert "recompiles" in result["table"].splitlines()[0]


@pytest.mark.parametrize("count", [1, 2, 8, 30])
def test_tiny_shapes_prompts_exist_for_every_concurrency(count: int) -> None:
    """c=1 once crashed the bench after its runs: the scored prompt set needs >= 6 to cover."""
    prompts = parse(["--model", "builtin:tiny-shapes"]).prompts(count)
    assert len(prompts) == count and len(set(prompts)) == count
    assert prompts == parse(["--model", "builtin:tiny-shapes"]).prompts(30)[:count]
