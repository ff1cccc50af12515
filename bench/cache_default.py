"""`stagemesh bench cache_default`: the step-cache threshold the DiT ships with, by measurement.

The rule (issue 21): the default is the setting with the most reuse that keeps each of
tiny-shapes' four attributes (colour, shape, position, background) within `--tolerance`
points of the cache off, on its whole evaluation grammar, for every seed given. One
`stagemesh serve` runs tiny-shapes with a First-Block-Cache DiT whose other cache options are
the stage's defaults (warm-up, final steps, max skips); each threshold is a per-request
`step_cache_threshold` (0 = off), so every arm runs on the same stages. Per threshold and seed:
the attributes' accuracy (`stagemesh.models.tiny_shapes.evaluate`) and the reused share of DiT
rows (`stagemesh_dit_rows_total{pass}`). JSON + PNG. Accuracy does not depend on the machine's
load; the reused share is counted, not timed.
"""

from __future__ import annotations

import argparse
import base64
import io
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from stagemesh.bench.common import (
    BarGroup,
    machine_info,
    markdown_table,
    metric_value,
    parse_metrics,
    serve_mesh,
    write_bar_chart,
    write_json,
)

log = logging.getLogger(__name__)

RECIPE = "cache-default"
STEPS, GUIDANCE, SIZE = 16, 4.0, 32  # tiny-shapes' evaluation settings
CONCURRENCY = 8
RECIPE_YAML = """\
recipes:
  - name: {name}
    task: text-to-image
    model: builtin:tiny-shapes
    stages:
      tokenizer: {{address: "127.0.0.1:1", metrics_port: 1}}
      dit: {{address: "127.0.0.1:2", metrics_port: 2,
            options: {{step_cache: first_block, step_cache_threshold: {low},
                       max_step_cache_threshold: {high}}}}}
      vae: {{address: "127.0.0.1:3", metrics_port: 3}}
"""


def _rows(client: httpx.Client) -> dict[str, float]:
    """The DiT's rows so far, by pass (full | reused)."""
    stages = client.get("/v1/stages").json()["stages"]
    url = next(s.get("metrics_url") or s["metricsUrl"] for s in stages if s["name"] == "dit")
    samples = parse_metrics(httpx.get(url, timeout=10).text)
    return {kind: metric_value(samples, "stagemesh_dit_rows_total", **{"pass": kind})
            for kind in ("full", "reused")}


def _arm(client: httpx.Client, threshold: float, seed: int, out: Path,
         prompts: list[str]) -> dict[str, Any]:
    """The evaluation at one threshold and seed: accuracy by attribute and the reused share.
    `CONCURRENCY` requests at a time, so the DiT batches them as it would in service (each row
    decides for itself)."""
    from PIL import Image

    from stagemesh.models.tiny_shapes.evaluate import evaluate

    def fetch(prompt: str) -> np.ndarray:
        response = client.post("/v1/images/generations", json={
            "model": RECIPE, "prompt": prompt, "size": f"{SIZE}x{SIZE}", "seed": seed,
            "num_inference_steps": STEPS, "true_cfg_scale": GUIDANCE, "negative_prompt": "",
            "step_cache_threshold": threshold})
        if response.status_code != 200:
            raise RuntimeError(f"{prompt!r} at threshold {threshold}: {response.status_code} "
                               f"{response.text}")
        png = base64.b64decode(response.json()["data"][0]["b64_json"])
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))

    before = _rows(client)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        images = dict(zip(prompts, pool.map(fetch, prompts), strict=True))
    after = _rows(client)
    metrics = evaluate(lambda prompt, _seed: images[prompt],
                       out / f"threshold-{threshold:g}-seed-{seed}", prompts, seed=seed)
    full, reused = (after[k] - before[k] for k in ("full", "reused"))
    return {"threshold": threshold, "seed": seed, "n": metrics["n"],
            "accuracy": metrics["accuracy"], "reused_share": reused / (full + reused)}


def choose(arms: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Per threshold: mean reused share, each attribute's worst drop from threshold 0 over the
    seeds (points), and whether it is within `tolerance`; the chosen threshold is the one with
    the most reuse among those within it."""
    off = {arm["seed"]: arm["accuracy"] for arm in arms if arm["threshold"] == 0}
    rows: dict[float, dict[str, Any]] = {}
    for arm in arms:
        row = rows.setdefault(arm["threshold"], {"threshold": arm["threshold"], "reused": [],
                                                 "drop_points": {}})
        row["reused"].append(arm["reused_share"])
        for name, accuracy in arm["accuracy"].items():
            drop = 100.0 * (off[arm["seed"]][name] - accuracy)
            row["drop_points"][name] = max(row["drop_points"].get(name, -100.0), drop)
    table = []
    for row in sorted(rows.values(), key=lambda r: r["threshold"]):
        row["reused_share"] = float(np.mean(row.pop("reused")))
        row["within_tolerance"] = max(row["drop_points"].values()) <= tolerance
        table.append(row)
    allowed = [row for row in table if row["within_tolerance"]]
    best = max(allowed, key=lambda r: (r["reused_share"], -r["threshold"]))
    return {"by_threshold": table, "chosen_threshold": best["threshold"],
            "chosen_reused_share": best["reused_share"]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="stagemesh bench cache_default", description=__doc__)
    parser.add_argument("--thresholds", default="0,0.03,0.05,0.08,0.12,0.2",
                        help="comma-separated; 0 (cache off) is always included")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--subset", type=int, default=0,
                        help="score subset_prompts(n) only (0: the whole grammar)")
    parser.add_argument("--tolerance", type=float, default=2.0, help="points per attribute")
    parser.add_argument("--out", type=Path, default=Path("bench-results/cache-default"))
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    thresholds = sorted({0.0, *(float(t) for t in options.thresholds.split(","))})
    if len(thresholds) < 2 or thresholds[0] < 0:
        parser.error("--thresholds: at least one threshold above 0, none below")
    seeds = [int(s) for s in options.seeds.split(",")]
    from stagemesh.models.tiny_shapes.evaluate import all_prompts, subset_prompts

    prompts = subset_prompts(options.subset) if options.subset else all_prompts()
    recipe = options.out / "recipe.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(RECIPE_YAML.format(name=RECIPE, low=min(t for t in thresholds if t > 0),
                                         high=max(thresholds)))
    before = machine_info()
    with serve_mesh(recipe, options.out / "serve.log") as mesh, httpx.Client(
            base_url=mesh.base_url, timeout=300.0) as client:
        arms = [_arm(client, threshold, seed, options.out, prompts)
                for seed in seeds for threshold in thresholds]
    chosen = choose(arms, options.tolerance)
    table = markdown_table(
        ["threshold", "reused", *(f"{a} drop (pts)" for a in arms[0]["accuracy"]), "within"],
        [[f"{r['threshold']:g}", f"{r['reused_share']:.0%}",
          *(f"{d:+.1f}" for d in r["drop_points"].values()),
          "yes" if r["within_tolerance"] else "no"] for r in chosen["by_threshold"]])
    write_json(options.out / "cache_default.json", {
        "benchmark": "cache_default", "steps": STEPS, "size": SIZE, "seeds": seeds,
        "tolerance_points": options.tolerance, "cache": "first_block with the stage's "
        "default warm-up, final steps and max skips", "arms": arms, **chosen, "table": table,
        "machine_before": before, "machine_after": machine_info()})
    rows = chosen["by_threshold"]
    write_bar_chart(options.out / "cache_default.png", [
        BarGroup(title="reused share of DiT rows", ylabel="share",
                 categories=[f"{r['threshold']:g}" for r in rows],
                 series={"reused": [r["reused_share"] for r in rows]}),
        BarGroup(title="worst attribute drop vs off (points)", ylabel="points",
                 categories=[f"{r['threshold']:g}" for r in rows],
                 series={"drop": [max(r["drop_points"].values()) for r in rows]})],
        suptitle="stagemesh bench cache_default (tiny-shapes)")
    log.info("chosen threshold %g (reused %.0f%%)\n%s", chosen["chosen_threshold"],
             100 * chosen["chosen_reused_share"], table)
