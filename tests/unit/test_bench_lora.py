"""`stagemesh bench lora`: its recipe (one DiT holding every adapter resident), what each arm's
requests name, and its report (each arm against the burst without adapters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.bench.lora import (
    ADAPTERS,
    RANK,
    RECIPE,
    Cell,
    Run,
    arm_adapters,
    parse,
    recipes_yaml,
    report,
    request_body,
)
from stagemesh.gateway.recipes import load_recipes

pytestmark = pytest.mark.unit


def test_the_default_run_is_the_issues_and_the_dry_run_is_tiny() -> None:
    options = parse([])
    assert options.runs == (Run("builtin:qwen-image-bench", 128), Run("builtin:tiny-shapes", 32))
    assert options.concurrency == 8
    dry = parse(["--dry-run"])
    assert dry.runs == (Run("builtin:qwen-image-tiny", 32),) and dry.steps == 2
    with pytest.raises(SystemExit):
        parse(["--runs", "builtin:tiny-shapes"])


def test_one_dit_holds_every_adapter(tmp_path: Path) -> None:
    path = tmp_path / "recipes.yaml"
    path.write_text(recipes_yaml(Run("builtin:tiny-shapes", 32), 20, tmp_path / "loras"))
    dit = load_recipes(path)[RECIPE].stages["dit"]
    assert dit.options == {"lora_dir": str(tmp_path / "loras"), "max_loras": ADAPTERS,
                           "max_lora_rank": RANK}


def test_each_arm_names_its_count_of_distinct_adapters() -> None:
    assert arm_adapters("mesh-0", 8) == [None] * 8
    assert set(arm_adapters("mesh-1", 8)) == {"lora-0"}
    assert len(set(arm_adapters("mesh-8", 8))) == 8 == len(set(arm_adapters("diffusers", 8)))
    body = request_body(Run("m", 32), 4, 3, "p", "lora-3")
    assert body["lora"] == [{"name": "lora-3", "scale": 1.0}] and body["seed"] == 3
    assert "lora" not in request_body(Run("m", 32), 4, 3, "p", None)


def test_the_report_compares_every_arm_with_the_burst_without_adapters() -> None:
    options = parse(["--runs", "builtin:qwen-image-bench@128", "--rounds", "3"])
    run = options.runs[0]
    cells = {run: {"mesh-0": Cell([1.0] * 8, [4.0, 5.0, 6.0]),
                   "mesh-8": Cell([1.0] * 7 + [2.0], [4.5, 4.0, 3.0]),
                   "diffusers": Cell([0.5] * 8, [2.0, 2.0, 2.0])}}
    result = report(options, cells)
    rows = {row["arm"]: row for row in result["results"]}
    assert rows["mesh-8"]["share_of_no_lora"] == pytest.approx(0.8)  # medians 4.0 / 5.0
    assert rows["diffusers"]["share_of_no_lora"] == pytest.approx(0.4)
    assert rows["mesh-8"]["latency_s"]["p99"] == pytest.approx(1.93)
    assert "| qwen-image-bench 128px | mesh-8 | 8 | 4.000 |" in result["table"]
