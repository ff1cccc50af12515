"""`stagemesh bench accel`: the DiT's step cache, weight quantization and compiled blocks against
diffusers, alternating, at c=1 and c=8.

Arms, on one model folder, prompt set, size, steps and guidance (true CFG, empty negative):

- `diffusers`: stock `QwenImagePipeline` in this process at its defaults (no cache);
- `diffusers+fbc`: the same with `FirstBlockCacheConfig(threshold)` on its transformer;
- `mesh-off`, `mesh-first_block`, `mesh-taylorseer`: one `stagemesh serve` with three recipes
  whose DiT stages differ only in their step-cache options (same threshold, warm-up, final
  steps and max skips as given here);
- `mesh-int8`, `mesh-compile`, `mesh-int8-compile` (step cache off): `quantization: int8` on
  the DiT and the tokenizer, `compile: blocks` on the DiT, and both.

`--suite` picks the arms: `cache` (the default: diffusers, diffusers+fbc and the step-cache
arms), `quant` (diffusers, mesh-off and the quantization/compile arms) or `all`. Every suite
runs stock diffusers in the same run. `--dry-run` writes the recipes and the plan and runs
nothing.

Each round runs every arm at every concurrency, arms in turn (drift in the machine's load hits
them alike): the mesh gets a burst of c simultaneous requests (seeds 0..c-1), diffusers serves
the same c requests one after another (what a user of the library does). Reported per arm and
c: images/s, p50/p99 latency, the reused share of DiT rows (the stage's
`stagemesh_dit_rows_total{pass}`), graphs the DiT compiled after its warm-up
(`stagemesh_dit_recompiles_total`, 0 when healthy), and quality against the arm's exact twin
on the same seeds (mesh arms against `mesh-off`: float weights, eager blocks, no cache;
`diffusers+fbc` against `diffusers`): PSNR, and on tiny-shapes the four attributes' accuracy
(`stagemesh.models.tiny_shapes.scoring`). JSON + PNG; the README table comes from the JSON's
`table` field. A benchmark, not a test: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import logging
import math
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from stagemesh.bench.common import (
    BarGroup,
    Stopwatch,
    interrupt_on_sigterm,
    machine_info,
    markdown_table,
    metric_value,
    scrape,
    serve_mesh,
    summarize,
    write_bar_chart,
    write_json,
)
from stagemesh.services.dit.compile import CompileMode
from stagemesh.services.dit.step_cache import StepCacheConfig, StepCacheMethod
from stagemesh.shared.quantization import Quantization

if TYPE_CHECKING:  # diffusers loads only when the benchmark runs
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

log = logging.getLogger(__name__)

DEFAULT_MODEL = "builtin:qwen-image-bench"
TINY_SHAPES = "builtin:tiny-shapes"
GUIDANCE = 4.0
REQUEST_TIMEOUT_S = 900.0
PEER, PEER_FBC = "diffusers", "diffusers+fbc"
#: The step-cache arms: each recipe's DiT runs one method.
MESH_ARMS = {f"mesh-{method.value}": method for method in StepCacheMethod}
EXACT = "mesh-off"


@dataclass(frozen=True)
class Acceleration:
    """What a quantization/compile arm sets (its step cache off)."""

    quantization: Quantization = Quantization.NONE  # the DiT's and the tokenizer's
    compile: CompileMode = CompileMode.OFF  # the DiT's


#: The quantization and compile arms.
QUANT_ARMS = {
    "mesh-int8": Acceleration(quantization=Quantization.INT8),
    "mesh-compile": Acceleration(compile=CompileMode.BLOCKS),
    "mesh-int8-compile": Acceleration(Quantization.INT8, CompileMode.BLOCKS),
}
#: The arms each `--suite` runs, stock diffusers always among them.
SUITES: dict[str, tuple[str, ...]] = {
    "cache": (PEER, PEER_FBC, *MESH_ARMS),
    "quant": (PEER, EXACT, *QUANT_ARMS),
    "all": (PEER, PEER_FBC, *MESH_ARMS, *QUANT_ARMS),
}
#: Each arm's quality is measured against this exact twin (no cache, float weights, eager).
TWIN = {PEER_FBC: PEER, **{arm: EXACT for arm in (*MESH_ARMS, *QUANT_ARMS)}}

# Stage addresses are placeholders (`--stage-ports auto` moves every stage to a free port), but
# distinct: recipes that name one address share that stage.
RECIPE_TEMPLATE = """\
  - name: {name}
    task: text-to-image
    model: {model}
    stages:
      tokenizer: {{address: "127.0.0.1:{port}1", metrics_port: {port}1,
                  options: {{{tokenizer_options}}}}}
      dit: {{address: "127.0.0.1:{port}2", metrics_port: {port}2, options: {{{dit_options}}}}}
      vae: {{address: "127.0.0.1:{port}3", metrics_port: {port}3}}
    defaults: {{width: {size}, height: {size}, num_inference_steps: {steps},
               true_cfg_scale: {cfg}, negative_prompt: ""}}
"""


@dataclass(frozen=True)
class Options:
    model: str
    size: int
    steps: int
    concurrency: tuple[int, ...]
    rounds: int
    cache: StepCacheConfig  # method unset: each mesh arm sets its own
    out: Path
    arms: tuple[str, ...] = SUITES["cache"]
    dry_run: bool = False  # write the recipes and the plan, run nothing

    def mesh_arms(self) -> list[str]:
        """The arms served by the mesh (one recipe each), in run order."""
        return [arm for arm in self.arms if arm not in (PEER, PEER_FBC)]

    def prompts(self, count: int) -> list[str]:
        """`count` prompts: the tiny-shapes grammar's (scored), else one fixed prompt."""
        if self.model == TINY_SHAPES:
            from stagemesh.models.tiny_shapes.evaluate import MIN_SUBSET_PROMPTS, subset_prompts

            return subset_prompts(max(count, MIN_SUBSET_PROMPTS))[:count]
        return ["a red circle on the left"] * count


@dataclass
class Cell:
    """One arm at one concurrency, over every round."""

    latencies: list[float] = field(default_factory=list)
    images_per_s: list[float] = field(default_factory=list)
    rows: dict[str, float] = field(default_factory=lambda: {"full": 0.0, "reused": 0.0})
    images: dict[int, np.ndarray] = field(default_factory=dict)  # seed -> RGB, the last round
    recompiles: float = 0.0  # graphs the DiT compiled after its warm-up, during the arm's bursts


def recipes_yaml(options: Options) -> str:
    """One recipe per mesh arm: the same model and defaults, the DiT's step cache (and the
    quantization and compile of the DiT and tokenizer) apart."""
    cache = options.cache
    entries = []
    for index, arm in enumerate(options.mesh_arms(), start=1):
        method = MESH_ARMS.get(arm, StepCacheMethod.OFF)
        accel = QUANT_ARMS.get(arm, Acceleration())
        dit = (
            f"step_cache: '{method.value}', step_cache_threshold: {cache.threshold}, "
            f"max_step_cache_threshold: {max(cache.threshold, cache.max_threshold)}, "
            f"step_cache_interval: {cache.interval}, "
            f"step_cache_warmup_steps: {cache.warmup_steps}, "
            f"step_cache_final_steps: {cache.final_steps}, "
            f"step_cache_max_skips: {cache.max_skips}, "
            f"quantization: '{accel.quantization.value}', compile: '{accel.compile.value}'"
        )
        entries.append(RECIPE_TEMPLATE.format(
            name=arm, port=index, model=options.model, size=options.size, steps=options.steps,
            cfg=GUIDANCE, dit_options=dit,
            tokenizer_options=f"quantization: '{accel.quantization.value}'"))
    return "recipes:\n" + "".join(entries)


async def mesh_burst(client: httpx.AsyncClient, arm: str, c: int, options: Options,
                     cell: Cell) -> None:
    """c simultaneous requests to `arm`'s recipe; the DiT's rows by pass around them."""
    metrics_url = await _dit_metrics_url(client, arm)
    before = await scrape(client, metrics_url)

    async def one(seed: int, prompt: str) -> None:
        body = {"model": arm, "prompt": prompt, "size": f"{options.size}x{options.size}",
                "seed": seed, "num_inference_steps": options.steps, "true_cfg_scale": GUIDANCE,
                "negative_prompt": ""}
        watch = Stopwatch()
        response = await client.post("/v1/images/generations", json=body,
                                     timeout=REQUEST_TIMEOUT_S)
        response.raise_for_status()
        cell.latencies.append(watch.elapsed())
        cell.images[seed] = _rgb(base64.b64decode(response.json()["data"][0]["b64_json"]))

    watch = Stopwatch()
    await asyncio.gather(*(one(seed, p) for seed, p in enumerate(options.prompts(c))))
    cell.images_per_s.append(c / watch.elapsed())
    after = await scrape(client, metrics_url)
    for kind in cell.rows:
        labels = {"pass": kind}
        cell.rows[kind] += (metric_value(after, "stagemesh_dit_rows_total", **labels)
                            - metric_value(before, "stagemesh_dit_rows_total", **labels))
    cell.recompiles += (metric_value(after, "stagemesh_dit_recompiles_total")
                        - metric_value(before, "stagemesh_dit_recompiles_total"))


async def _dit_metrics_url(client: httpx.AsyncClient, recipe: str) -> str:
    response = await client.get("/v1/stages")
    response.raise_for_status()
    return next(str(stage["metrics_url"]) for stage in response.json()["stages"]
                if stage["name"] == "dit" and stage["recipe"] == recipe)


@contextlib.contextmanager
def counting_fbc(cell: Cell) -> Iterator[None]:
    """diffusers' FirstBlockCache decisions counted into the cell's rows (one per transformer
    call: a request's branch at a step), as the mesh's stagemesh_dit_rows_total counts them."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    decide = FBCHeadBlockHook._should_compute_remaining_blocks

    def counted(hook: FBCHeadBlockHook, residual: Any) -> bool:
        compute: bool = decide(hook, residual)
        cell.rows["full" if compute else "reused"] += 1
        return compute

    FBCHeadBlockHook._should_compute_remaining_blocks = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        FBCHeadBlockHook._should_compute_remaining_blocks = decide  # type: ignore[method-assign]


def peer_serial(pipe: QwenImagePipeline, arm: str, c: int, options: Options, cell: Cell) -> None:
    """The c requests one after another in diffusers, its cache on for `diffusers+fbc`."""
    import torch
    from diffusers import FirstBlockCacheConfig

    with contextlib.ExitStack() as stack:
        if arm == PEER_FBC:
            config = FirstBlockCacheConfig(threshold=options.cache.threshold)
            pipe.transformer.enable_cache(config)
            stack.callback(pipe.transformer.disable_cache)
            stack.enter_context(counting_fbc(cell))
        watch = Stopwatch()
        for seed, prompt in enumerate(options.prompts(c)):
            one = Stopwatch()
            image = pipe(prompt=prompt, negative_prompt="", true_cfg_scale=GUIDANCE,
                         height=options.size, width=options.size,
                         num_inference_steps=options.steps, output_type="np",
                         generator=torch.Generator("cpu").manual_seed(seed)).images[0]
            cell.latencies.append(one.elapsed())
            cell.images[seed] = (np.asarray(image) * 255.0).round().astype(np.uint8)
        cell.images_per_s.append(c / watch.elapsed())


def _rgb(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def attribute_accuracy(images: dict[int, np.ndarray], options: Options) -> dict[str, float]:
    """tiny-shapes: each attribute's share of images read as their prompt says."""
    from stagemesh.models.tiny_shapes.scoring import score

    prompts = options.prompts(len(images))
    scores = [score(images[seed], prompts[seed]) for seed in sorted(images)]
    return {name: statistics.mean(s[name] for s in scores) for name in scores[0]}


def run(options: Options, pipe: QwenImagePipeline, base_url: str) -> dict[tuple[str, int], Cell]:
    """Every round: every concurrency, every arm in turn."""
    cells: dict[tuple[str, int], Cell] = {}
    arms, mesh_arms = options.arms, options.mesh_arms()

    async def mesh_round(client: httpx.AsyncClient, arm: str, c: int) -> None:
        await mesh_burst(client, arm, c, options, cells.setdefault((arm, c), Cell()))

    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(base_url=base_url)
    try:
        for arm in mesh_arms:  # warm-up: one request per recipe
            loop.run_until_complete(mesh_burst(client, arm, 1, options, Cell()))
        peer_serial(pipe, PEER, 1, options, Cell())
        for round_index in range(options.rounds):
            for c in options.concurrency:
                for arm in arms:
                    if arm in mesh_arms:
                        loop.run_until_complete(mesh_round(client, arm, c))
                    else:
                        peer_serial(pipe, arm, c, options, cells.setdefault((arm, c), Cell()))
                    log.info("round %d c=%d %s: %.3f images/s", round_index, c, arm,
                             cells[(arm, c)].images_per_s[-1])
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    return cells


def report(options: Options, cells: dict[tuple[str, int], Cell]) -> dict[str, Any]:
    rows, results = [], []
    for (arm, c), cell in cells.items():
        twin = cells.get((TWIN.get(arm, arm), c))
        total = cell.rows["full"] + cell.rows["reused"]
        entry: dict[str, Any] = {
            "arm": arm, "concurrency": c,
            "images_per_s": statistics.median(cell.images_per_s),
            "latency_s": summarize(cell.latencies),
            "reused_share": cell.rows["reused"] / total if total else None,
            "recompiles": cell.recompiles,
        }
        if twin is not None and twin is not cell:
            entry["psnr_vs_off"] = statistics.mean(
                psnr(cell.images[s], twin.images[s]) for s in cell.images)
        if options.model == TINY_SHAPES:
            entry["attributes"] = attribute_accuracy(cell.images, options)
        results.append(entry)
        rows.append([arm, c, f"{entry['images_per_s']:.3f}", f"{entry['latency_s']['p50']:.2f}",
                     f"{entry['latency_s']['p99']:.2f}",
                     "-" if entry["reused_share"] is None else f"{entry['reused_share']:.0%}",
                     f"{entry.get('psnr_vs_off', math.nan):.1f}",
                     f"{cell.recompiles:.0f}" if arm in options.mesh_arms() else "-"])
    headers = ["arm", "c", "images/s", "p50 s", "p99 s", "reused", "PSNR vs off", "recompiles"]
    return {
        "benchmark": "accel", "date": datetime.now(UTC).isoformat(), "machine": machine_info(),
        "options": {**asdict(options), "cache": {**asdict(options.cache), "method": None},
                    "out": str(options.out)},
        "results": results, "table": markdown_table(headers, rows),
    }


def chart(result: dict[str, Any], path: Path) -> Path:
    by_c: dict[int, dict[str, float]] = {}
    for entry in result["results"]:
        by_c.setdefault(entry["concurrency"], {})[entry["arm"]] = entry["images_per_s"]
    arms = list(result["options"]["arms"])
    panels = [BarGroup(title=f"c={c}", ylabel="images/s", categories=arms,
                       series={"images/s": [values.get(arm, 0.0) for arm in arms]})
              for c, values in sorted(by_c.items())]
    return write_bar_chart(path, panels, "step cache, int8, compile: diffusers against the mesh")


def parse(argv: list[str]) -> Options:
    default = StepCacheConfig()
    parser = argparse.ArgumentParser(prog="stagemesh bench accel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"{DEFAULT_MODEL} (PSNR) or {TINY_SHAPES} (+ attribute accuracy)")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=default.threshold)
    parser.add_argument("--interval", type=int, default=default.interval)
    parser.add_argument("--warmup-steps", type=int, default=default.warmup_steps)
    parser.add_argument("--final-steps", type=int, default=default.final_steps)
    parser.add_argument("--max-skips", type=int, default=default.max_skips)
    parser.add_argument("--as-diffusers", action="store_true",
                        help="warm-up, final steps and max skips 0: diffusers' decisions")
    parser.add_argument("--suite", choices=sorted(SUITES), default="cache",
                        help="cache: the step-cache arms; quant: int8 and compile; all: both")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the recipes and the plan to --out, run nothing")
    parser.add_argument("--out", default="bench-results/accel")
    args = parser.parse_args(argv)
    cache = StepCacheConfig(
        threshold=args.threshold, interval=args.interval,
        warmup_steps=0 if args.as_diffusers else args.warmup_steps,
        final_steps=0 if args.as_diffusers else args.final_steps,
        max_skips=0 if args.as_diffusers else args.max_skips,
    )  # fmt: skip
    return Options(model=args.model, size=args.size, steps=args.steps,
                   concurrency=tuple(int(c) for c in args.concurrency.split(",") if c.strip()),
                   rounds=args.rounds, cache=cache, out=Path(args.out),
                   arms=SUITES[args.suite], dry_run=args.dry_run)


def main(argv: list[str]) -> None:
    options = parse(argv)
    if options.dry_run:
        dry_run(options)
        return
    from stagemesh.bench.throughput import load_peer
    from stagemesh.models.registry import resolve_model

    interrupt_on_sigterm()
    pipe = load_peer(resolve_model(options.model))
    with tempfile.TemporaryDirectory() as tmp:
        recipes = Path(tmp) / "recipes.yaml"
        recipes.write_text(recipes_yaml(options))
        with serve_mesh(recipes, options.out / "serve.log") as served:
            cells = run(options, pipe, served.base_url)
    result = report(options, cells)
    write_json(options.out / "accel.json", result)
    chart(result, options.out / "accel.png")
    log.info("results in %s\n%s", options.out, result["table"])


def dry_run(options: Options) -> None:
    """The run's recipes (`recipes.yaml`) and plan (`plan.json`: arms, twins, rounds) in
    --out, without loading a model or starting the mesh."""
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "recipes.yaml").write_text(recipes_yaml(options))
    plan = {"arms": list(options.arms), "mesh_arms": options.mesh_arms(),
            "twins": {arm: TWIN[arm] for arm in options.arms if TWIN.get(arm, arm) != arm},
            "concurrency": list(options.concurrency), "rounds": options.rounds,
            "model": options.model, "size": options.size, "steps": options.steps}
    write_json(options.out / "plan.json", plan)
    log.info("dry run: recipes and plan in %s", options.out)
