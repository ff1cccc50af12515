"""`stagemesh bench preview`: what step previews cost the DiT (issue 26: <= 5% of the step).

One request (true CFG) through the DiT stage's own adapter, no gRPC, at `--size` on `--model`
(default qwen-image-bench at 128 px: the issue's setting), in arms interleaved round by round
so that a noisy machine's drift hits every arm alike:

    off            no previews: the baseline step
    <painter>/k    previews every k steps through that painter: `projection` (the linear map,
                   the stage's default; fitted here on generic pictures when the folder has
                   none, not written to the folder) and `decoder` (the folder VAE's own
                   decoder, `preview_painter: decoder`, measured here whatever the VAE's size)

Per arm: the median step and its overhead over `off`, and the preview path timed directly
(`stagemesh_preview_seconds`, as the stage records it) as a share of the median `off` step
divided by k: the number the issue's bar is about (the step overhead is the same thing seen
through the machine's noise). `--dry-run`: qwen-image-tiny at 64 px, 3 steps, one round, on the
CPU (what the tests run). Writes preview.json.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
from prometheus_client import REGISTRY

from stagemesh.bench.common import (
    BarGroup,
    machine_info,
    markdown_table,
    write_bar_chart,
    write_json,
)
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.registry import resolve_model
from stagemesh.services.dit.preview import (
    DEFAULT_PREVIEW_SIZE,
    Painter,
    PreviewOptions,
    Projection,
)
from stagemesh.services.dit.preview_decode import (
    DecoderPainter,
    decoder_paints,
    folder_vae_class,
)
from stagemesh.services.dit.preview_fit import fit_generic
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.shared.devices import DTYPE_NAMES, Placement
from stagemesh.shared.engine.adapter import EngineRequest

log = logging.getLogger(__name__)

PREVIEW_METRIC = "stagemesh_preview_seconds"
GUIDANCE = 4.0
TEXT_TOKENS = 24


@dataclass(frozen=True)
class Arm:
    name: str
    painter: Painter | None
    every: int = 0  # 0: no previews


def painters(model: Path, device: torch.device) -> dict[str, Painter]:
    """The decoder (whatever its size: the bench measures it) and the projection (the folder's,
    or one fitted here on generic pictures)."""
    vae_class = folder_vae_class(model)
    if vae_class is None:
        raise SystemExit(f"{model}: no VAE previews know")
    projection = Projection.load(model) or fit_generic(model, write=False)
    return {"decoder": DecoderPainter.load(model, vae_class, device),
            "projection": projection.to(device)}


def preview_seconds() -> tuple[float, float]:
    """(sum, count) of the preview histogram, over every label set."""
    total = REGISTRY.get_sample_value(f"{PREVIEW_METRIC}_sum") or 0.0
    count = REGISTRY.get_sample_value(f"{PREVIEW_METRIC}_count") or 0.0
    return total, count


def run_arm(adapter: DenoiseAdapter, arm: Arm, payload: DenoiseInput, preview_size: int,
            ) -> tuple[list[float], float]:
    """One request through `arm`: (each step's seconds, seconds per preview)."""
    adapter.painter = arm.painter
    preview = PreviewOptions(arm.every, preview_size) if arm.every else None
    state = adapter.prepare(EngineRequest(request_id=arm.name,
                                          payload=replace(payload, preview=preview)))
    before = preview_seconds()
    steps = []
    for _ in range(payload.num_inference_steps):
        started = time.perf_counter()
        adapter.step([state])
        steps.append(time.perf_counter() - started)
    adapter.release(state)
    after = preview_seconds()
    count = after[1] - before[1]
    return steps, (after[0] - before[0]) / count if count else 0.0


def measure(adapter: DenoiseAdapter, arms: list[Arm], payload: DenoiseInput,
            preview_size: int, rounds: int) -> dict[str, dict[str, float]]:
    steps: dict[str, list[float]] = {arm.name: [] for arm in arms}
    previews: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for arm in arms:  # warm-up: first-call allocations, kernel choice
        run_arm(adapter, arm, payload, preview_size)
    for _ in range(rounds):
        for arm in arms:
            seconds, per_preview = run_arm(adapter, arm, payload, preview_size)
            steps[arm.name] += seconds[1:]  # the first step carries the request's setup
            previews[arm.name].append(per_preview)
    baseline = statistics.median(steps["off"])
    results = {}
    for arm in arms:
        median = statistics.median(steps[arm.name])
        per_preview = statistics.median(previews[arm.name])
        results[arm.name] = {
            "median_step_s": median,
            "step_overhead_pct": 100 * (median - baseline) / baseline,
            "preview_s": per_preview,
            "preview_cost_pct": 100 * per_preview / arm.every / baseline if arm.every else 0.0,
        }
        log.info("%s: %s", arm.name, results[arm.name])
    return results


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench preview", description=__doc__)
    parser.add_argument("--model", default="builtin:qwen-image-bench")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--preview-size", type=int, default=DEFAULT_PREVIEW_SIZE)
    parser.add_argument("--every", default="1,4", help="comma-separated k of the preview arms")
    parser.add_argument("--steps", type=int, default=12, help="denoise steps per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (stages use 1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES.values()))
    parser.add_argument("--dry-run", action="store_true",
                        help="qwen-image-tiny at 64 px, 3 steps, one round (what tests run)")
    parser.add_argument("--out", default="bench-results/preview")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.size, args.steps, args.rounds = "builtin:qwen-image-tiny", 64, 3, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    dtype = {name: dtype for dtype, name in DTYPE_NAMES.items()}[args.dtype]
    placement = Placement(torch.device(args.device), dtype)
    model = resolve_model(args.model)
    adapter = DenoiseAdapter(model, placement=placement)
    generator = torch.Generator().manual_seed(0)
    dim = adapter.transformer.config["joint_attention_dim"]
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    embeddings = PromptEmbeddings(torch.randn(1, TEXT_TOKENS, dim, generator=generator), mask,
                                  torch.randn(1, TEXT_TOKENS, dim, generator=generator), mask)
    payload = DenoiseInput(embeddings, args.size, args.size, args.steps, GUIDANCE, seed=0)
    arms = [Arm("off", None)] + [
        Arm(f"{name}/{every}", painter, every)
        for name, painter in painters(model, placement.device).items()
        for every in (int(k) for k in args.every.split(",") if k)]
    results = measure(adapter, arms, payload, args.preview_size, args.rounds)
    report: dict[str, object] = {
        "benchmark": "preview", "created": datetime.now(UTC).isoformat(),
        "machine": machine_info(), "dry_run": args.dry_run, "model": args.model,
        "device": args.device, "dtype": args.dtype, "size": args.size,
        "preview_size": args.preview_size, "steps": args.steps, "rounds": args.rounds,
        "decoder_allowed": decoder_paints(model),
        "results": results}
    rows = [[name, f"{r['median_step_s'] * 1000:.1f} ms", f"{r['step_overhead_pct']:+.1f}%",
             f"{r['preview_s'] * 1000:.2f} ms", f"{r['preview_cost_pct']:.2f}%"]
            for name, r in results.items()]
    report["table"] = markdown_table(
        ["arm", "median step", "step overhead", "per preview", "preview cost / step"], rows)
    path = write_json(Path(args.out) / "preview.json", report)
    write_bar_chart(Path(args.out) / "preview.png", [BarGroup(
        f"{args.model} at {args.size} px, {args.steps} steps", "ms per step (median)",
        list(results), {"step": [r["median_step_s"] * 1000 for r in results.values()]},
        [f"{r['preview_cost_pct']:.1f}%" for r in results.values()])],
        suptitle="stagemesh bench preview (label: preview cost / step)")
    log.info("results:\n%s", report["table"])
    log.info("wrote %s and preview.png", path)
    return report


if __name__ == "__main__":
    main()
