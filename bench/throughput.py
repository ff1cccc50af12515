"""`stagemesh bench throughput`: the mesh against stock diffusers, on the same cores, at scale.

Every number comes from one run, in three phases that never overlap (each would steal the
other's cores):

1. **peer** — stock `diffusers.QwenImagePipeline` in this process at its own default threads (what
   a user runs instead of the mesh), on the same model folder, prompt, seed, steps and guidance:
   the latency of one image per size. Serving c requests one after another takes c times that;
2. **ceiling** — the raw batching gain of the model itself: one transformer forward of
   2c rows (c requests x cond/uncond) against 2c forwards of one row, best of 3, for every
   size and concurrency c > 1, in a child process that runs as the DiT stage does (its thread
   count and OpenMP wait policy, see `stagemesh.cli`);
3. **mesh** — `stagemesh serve` at its defaults on the benchmark recipe: bursts of c
   simultaneous requests per size (and mixed sizes), then staggered arrivals (Poisson) at a few
   offered loads, as fractions of the mesh's measured burst throughput.

Reported: images/s, p50/p99 latency, the mesh's speed-up over the peer serving the same burst
serially, that speed-up as a share of the ceiling, and for mixed sizes each size's p99 against
its p99 under same-size load at the same concurrency (starvation shows there). The machine's
load average is recorded around every phase: other work on the machine skews every number.
JSON + PNG; the README table comes from the JSON's `table` field.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import multiprocessing
import os
import random
import statistics
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from stagemesh.bench.common import (
    BarGroup,
    Stopwatch,
    interrupt_on_sigterm,
    machine_info,
    markdown_table,
    serve_mesh,
    summarize,
    write_bar_chart,
    write_json,
)

if TYPE_CHECKING:  # torch and diffusers load only in the phases that need them
    from diffusers.models.transformers.transformer_qwenimage import (
        QwenImageTransformer2DModel,
    )
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
    from PIL.Image import Image

log = logging.getLogger(__name__)

RECIPE_NAME = "throughput"
MODEL = "builtin:qwen-image-bench"
PROMPT = "a red circle on the left"
#: `--distinct-prompts`: request i asks for PROMPTS[i % 8] (the peer too), so that no two
#: requests of a burst of up to 8 share a prompt (the tokenizer encodes each distinct text once).
PROMPTS = (PROMPT, "a blue square on the right", "a green triangle at the top",
           "a yellow circle at the bottom", "a black square on the left",
           "a white triangle on the right", "an orange circle at the top",
           "a purple square at the bottom")
NEGATIVE_PROMPT = ""
GUIDANCE = 4.0
REQUEST_TIMEOUT_S = 900.0

# Stage addresses are placeholders: `--stage-ports auto` moves every stage to a free port.
# No DiT option is set: the mesh runs at its defaults, as a user would start it.
RECIPE_TEMPLATE = """\
recipes:
  - name: {name}
    task: text-to-image
    model: {model}
    stages:
      tokenizer: {{address: "127.0.0.1:1", metrics_port: 1}}
      dit: {{address: "127.0.0.1:2", metrics_port: 2}}
      vae: {{address: "127.0.0.1:3", metrics_port: 3{vae_options}}}
    defaults: {{width: 128, height: 128, num_inference_steps: {steps},
               true_cfg_scale: {cfg}, negative_prompt: "{negative}"}}
"""


@dataclass(frozen=True)
class Options:
    sizes: tuple[int, ...]
    mixed_sizes: tuple[int, ...]
    concurrency: tuple[int, ...]
    steps: int
    rounds: int
    loads: tuple[float, ...]
    poisson_requests: int
    out: Path
    distinct_prompts: bool = False

    def prompt(self, seed: int) -> str:
        """The prompt of request `seed` (of the peer's image `seed` too)."""
        return PROMPTS[seed % len(PROMPTS)] if self.distinct_prompts else PROMPT


@dataclass
class Burst:
    """c requests sent at once: their latencies and the wall time until the last finished."""

    sizes: list[int]
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0

    @property
    def images_per_s(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0


# -- phase 1 and 2: in-process peer and raw ceiling ---------------------------------------------


def load_peer(folder: Path) -> QwenImagePipeline:
    """Stock diffusers `QwenImagePipeline` on the folder, in this process at its own default
    torch threads: what a user runs instead of the mesh."""
    import torch
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    pipe: QwenImagePipeline = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    log.info("peer: diffusers in-process with %d torch threads", torch.get_num_threads())
    return pipe


def peer_image(pipe: QwenImagePipeline, size: int, steps: int, seed: int,
               prompt: str = PROMPT) -> tuple[float, Image]:
    """Seconds for one image of the peer (the mesh's request: prompt, guidance, seed), and it."""
    import torch

    watch = Stopwatch()
    output = pipe(prompt=prompt, negative_prompt=NEGATIVE_PROMPT, true_cfg_scale=GUIDANCE,
                  height=size, width=size, num_inference_steps=steps,
                  generator=torch.Generator("cpu").manual_seed(seed))
    seconds = watch.elapsed()
    image: Image = output.images[0]
    return seconds, image


def measure_peer(folder: Path, sizes: tuple[int, ...], options: Options, repeats: int = 2
                 ) -> dict[int, float]:
    """Median seconds per image of stock diffusers at its default threads, per size."""
    pipe = load_peer(folder)
    result = {}
    for size in sizes:
        peer_image(pipe, size, options.steps, 0)  # warm-up: allocator, kernels
        result[size] = statistics.median(
            peer_image(pipe, size, options.steps, seed, options.prompt(seed))[0]
            for seed in range(1, repeats + 1))
        log.info("peer: %dpx %.2f s/image", size, result[size])
    return result


def measure_ceilings(folder: Path, sizes: tuple[int, ...], concurrency: tuple[int, ...]
                     ) -> dict[str, dict[str, float]]:
    """The raw batching gain per `<size>px c=<c>` (c > 1), measured in a child process set up
    like the DiT stage (see `_as_the_dit_stage`), so that this process's OpenMP state (the
    peer's) does not skew it."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch loaded yet
    with ProcessPoolExecutor(1, mp_context=context, initializer=_as_the_dit_stage) as child:
        return child.submit(_ceilings, folder, sizes, concurrency).result()


def _as_the_dit_stage() -> None:
    """Before torch loads: the DiT stage's thread count, OpenMP wait policy and malloc
    thresholds."""
    from stagemesh.cli import keep_freed_memory, quiet_openmp_waits, stage_threads

    quiet_openmp_waits()
    keep_freed_memory()
    import torch

    torch.set_num_threads(stage_threads("dit"))


def _ceilings(folder: Path, sizes: tuple[int, ...], concurrency: tuple[int, ...]
              ) -> dict[str, dict[str, float]]:
    import torch
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel.from_pretrained(
        folder, subfolder="transformer", local_files_only=True).eval()
    log.info("ceiling: %d torch threads, OMP_WAIT_POLICY=%s", torch.get_num_threads(),
             os.environ.get("OMP_WAIT_POLICY"))
    return {f"{size}px c={c}": measure_ceiling(transformer, size, 2 * c)
            for size in sizes for c in concurrency if c > 1}


def measure_ceiling(transformer: QwenImageTransformer2DModel, size: int, rows: int,
                    repeats: int = 3) -> dict[str, float]:
    """One forward of `rows` rows against `rows` forwards of one row (best of `repeats`)."""
    import torch

    factor = 16  # the bench model: VAE x8, 2x2 patches
    tokens = (size // factor) ** 2
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(rows, tokens, transformer.config["in_channels"], generator=generator)
    text = torch.randn(rows, 12, transformer.config["joint_attention_dim"],
                       generator=generator)
    shape = (1, size // factor, size // factor)

    @torch.inference_mode()
    def forward(first: int, count: int) -> None:
        transformer(hidden_states=latents[first:first + count],
                    encoder_hidden_states=text[first:first + count],
                    timestep=torch.full((count,), 0.5), img_shapes=[shape] * count,
                    return_dict=False)

    def best(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            watch = Stopwatch()
            run()
            times.append(watch.elapsed())
        return min(times)

    forward(0, 1)  # warm-up
    batched = best(lambda: forward(0, rows))
    single = best(lambda: [forward(row, 1) for row in range(rows)])
    log.info("ceiling at %dpx: %d rows in %.3f s vs %.3f s one by one (%.2fx)", size, rows,
             batched, single, single / batched)
    return {"size": size, "rows": rows, "batched_s": batched, "one_by_one_s": single,
            "speedup": single / batched}


# -- phase 3: the mesh --------------------------------------------------------------------------


async def generate_image(client: httpx.AsyncClient, size: int, seed: int, steps: int,
                         prompt: str = PROMPT) -> tuple[float, bytes]:
    """Seconds for one image from the mesh's OpenAI route, and the image (PNG bytes)."""
    body = {"model": RECIPE_NAME, "prompt": prompt, "size": f"{size}x{size}", "seed": seed,
            "num_inference_steps": steps, "true_cfg_scale": GUIDANCE,
            "negative_prompt": NEGATIVE_PROMPT}
    watch = Stopwatch()
    response = await client.post("/v1/images/generations", json=body, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    seconds = watch.elapsed()
    return seconds, base64.b64decode(response.json()["data"][0]["b64_json"])


async def generate(client: httpx.AsyncClient, size: int, seed: int, options: Options) -> float:
    return (await generate_image(client, size, seed, options.steps, options.prompt(seed)))[0]


async def burst(client: httpx.AsyncClient, sizes: list[int], options: Options) -> Burst:
    result = Burst(sizes=sizes)
    watch = Stopwatch()
    result.latencies = list(await asyncio.gather(
        *(generate(client, size, seed, options) for seed, size in enumerate(sizes))))
    result.wall = watch.elapsed()
    return result


async def poisson(client: httpx.AsyncClient, size: int, rate: float, count: int,
                  options: Options, rng: random.Random) -> Burst:
    """`count` requests with exponential gaps of mean 1/rate; wall from first send to last."""
    result = Burst(sizes=[size] * count)
    watch = Stopwatch()
    tasks = []
    for seed in range(count):
        if seed:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(generate(client, size, seed, options)))
    result.latencies = list(await asyncio.gather(*tasks))
    result.wall = watch.elapsed()
    return result


async def measure_mesh(base_url: str, options: Options) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        c_max = max(options.concurrency)
        # Warm-up: allocator and kernels at every batch size the first measured burst uses.
        await burst(client, [options.sizes[0]] * c_max, options)
        bursts: dict[str, list[Burst]] = {}
        for size in sorted({*options.sizes, *options.mixed_sizes}):
            for c in options.concurrency:
                key = f"{size}px c={c}"
                bursts[key] = [await burst(client, [size] * c, options)
                               for _ in range(options.rounds)]
                log.info("mesh %s: %.2f images/s", key, bursts[key][-1].images_per_s)
        if options.mixed_sizes:
            mixed = [options.mixed_sizes[i % len(options.mixed_sizes)] for i in range(c_max)]
            bursts[f"mixed c={c_max}"] = [await burst(client, mixed, options)
                                          for _ in range(options.rounds)]
        staggered: dict[str, Burst] = {}
        size = options.sizes[0]
        capacity = max(b.images_per_s for b in bursts[f"{size}px c={c_max}"])
        rng = random.Random(0)
        for load in options.loads:
            staggered[f"{size}px load={load:.0%}"] = await poisson(
                client, size, load * capacity, options.poisson_requests, options, rng)
    return {"bursts": bursts, "staggered": staggered, "capacity_images_per_s": capacity}


# -- report -------------------------------------------------------------------------------------


def report(options: Options, peer: dict[int, float], ceilings: dict[str, dict[str, float]],
           mesh: dict[str, Any], loads: dict[str, list[float]]) -> dict[str, Any]:
    rows, summary = [], {}
    for key, runs in mesh["bursts"].items():
        sizes = runs[0].sizes
        latencies = [x for run in runs for x in run.latencies]
        wall = statistics.median(run.wall for run in runs)
        peer_serial = sum(peer.get(s, 0.0) for s in sizes)
        speedup = peer_serial / wall if peer_serial else float("nan")
        c = len(sizes)
        ceiling = ceilings.get(key, {}).get("speedup")  # same-size bursts of c > 1 only
        share = speedup / ceiling if ceiling else None
        stats = summarize(latencies)
        by_size = {str(s): summarize([lat for run in runs
                                      for lat, sz in zip(run.latencies, run.sizes, strict=True)
                                      if sz == s]) for s in sorted(set(sizes))}
        summary[key] = {"c": c, "images_per_s": c / wall, "wall_s": wall, "latency": stats,
                        "latency_by_size": by_size, "peer_serial_s": peer_serial,
                        "speedup_over_peer_serial": speedup, "ceiling_share": share}
        rows.append([key, f"{c / wall:.2f}", f"{stats['p50']:.2f}", f"{stats['p99']:.2f}",
                     f"{peer_serial:.2f}", f"{speedup:.2f}x",
                     "" if share is None else f"{share:.0%}"])
    for key, run in mesh["staggered"].items():
        stats = summarize(run.latencies)
        summary[key] = {"images_per_s": run.images_per_s, "latency": stats}
        rows.append([key, f"{run.images_per_s:.2f}", f"{stats['p50']:.2f}",
                     f"{stats['p99']:.2f}", "", "", ""])
    table = markdown_table(["load", "images/s", "p50 s", "p99 s", "diffusers serial s",
                            "speed-up", "of ceiling"], rows)
    mixed = mixed_sizes_p99(summary)
    if mixed:
        table += "\n\n" + markdown_table(
            ["mixed sizes", "p99 s mixed", "p99 s same size", "ratio"],
            [[key, f"{m['mixed_p99']:.2f}", f"{m['same_size_p99']:.2f}", f"{m['ratio']:.2f}x"]
             for key, m in mixed.items()])
    return {"when": datetime.now(UTC).isoformat(),
            "machine": {**machine_info(), "load_average_by_phase": loads},
            "options": {k: str(v) for k, v in asdict(options).items()},
            "peer_seconds_per_image": peer, "ceiling": ceilings,
            "mesh_capacity_images_per_s": mesh["capacity_images_per_s"],
            "results": summary, "mixed_sizes_p99": mixed, "table": table}


def mixed_sizes_p99(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each size's p99 in the mixed burst against its p99 under same-size load at the same
    concurrency: a size starved by the others shows a large ratio."""
    result = {}
    for key, entry in summary.items():
        if not key.startswith("mixed "):
            continue
        for size, stats in entry["latency_by_size"].items():
            same = summary.get(f"{size}px c={entry['c']}")
            if same is None or not stats.get("n"):
                continue
            same_p99 = same["latency"]["p99"]
            result[f"{size}px in {key}"] = {"mixed_p99": stats["p99"], "same_size_p99": same_p99,
                                           "ratio": stats["p99"] / same_p99}
    return result


def chart(result: dict[str, Any], path: Path, options: Options) -> Path:
    panels = []
    for size in options.sizes:
        cats = [f"c={c}" for c in options.concurrency]
        keys = [f"{size}px c={c}" for c in options.concurrency]
        peer = result["peer_seconds_per_image"][size]
        panels.append(BarGroup(
            title=f"{size}px, {options.steps} steps: images/s", ylabel="images/s",
            categories=cats,
            series={"diffusers (serial)": [1 / peer] * len(cats),
                    "mesh": [result["results"][k]["images_per_s"] for k in keys]},
            labels=[f"{result['results'][k]['speedup_over_peer_serial']:.2f}x" for k in keys]))
    return write_bar_chart(path, panels, suptitle="stagemesh bench throughput")


def parse(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="stagemesh bench throughput", description=__doc__)
    parser.add_argument("--sizes", default="128,256", help="same-size bursts: pixels per side")
    parser.add_argument("--mixed-sizes", default="64,128,256",
                        help="sizes of the mixed burst ('' skips it)")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loads", default="0.5,0.8",
                        help="Poisson loads, fractions of the burst capacity ('' skips them)")
    parser.add_argument("--poisson-requests", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help="one size (128), c=1,4, 8 steps, one round: minutes, not tens")
    parser.add_argument("--distinct-prompts", action="store_true",
                        help="a different prompt per request (default: one prompt for all)")
    parser.add_argument("--out", default="bench-results/throughput")
    args = parser.parse_args(argv)

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    if args.quick:
        args.sizes, args.concurrency, args.steps, args.rounds = "128", "1,4", 8, 1
        args.mixed_sizes, args.loads, args.poisson_requests = "64,128", "0.5", 6
    return Options(sizes=ints(args.sizes), mixed_sizes=ints(args.mixed_sizes),
                   concurrency=ints(args.concurrency), steps=args.steps, rounds=args.rounds,
                   loads=tuple(float(x) for x in args.loads.split(",") if x.strip()),
                   poisson_requests=args.poisson_requests, out=Path(args.out),
                   distinct_prompts=args.distinct_prompts)


def write_recipes(path: Path, steps: int, vae_dtype: str | None = None) -> Path:
    """The benchmark recipe as a recipes file at `path`: the mesh at its defaults, but for the
    VAE's dtype when `vae_dtype` is given."""
    vae_options = "" if vae_dtype is None else f", options: {{dtype: {vae_dtype}}}"
    path.write_text(RECIPE_TEMPLATE.format(name=RECIPE_NAME, model=MODEL, steps=steps,
                                           cfg=GUIDANCE, negative=NEGATIVE_PROMPT,
                                           vae_options=vae_options))
    return path


def prepare_model() -> Path:
    """The benchmark model's folder, built in a child process like `stagemesh serve` does."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "stagemesh", "model", "prepare", MODEL],
                          check=True, capture_output=True, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


@contextmanager
def phase(name: str, loads: dict[str, list[float]]) -> Iterator[None]:
    """Record the machine's 1-minute load average before and after a phase."""
    before = os.getloadavg()[0]
    yield
    loads[name] = [before, os.getloadavg()[0]]
    log.info("%s: load average %.2f -> %.2f", name, *loads[name])


def main(argv: list[str]) -> None:
    options = parse(argv)
    interrupt_on_sigterm()
    folder = prepare_model()
    loads: dict[str, list[float]] = {}
    with phase("ceiling", loads):
        ceilings = measure_ceilings(folder, options.sizes, options.concurrency)
    with phase("peer", loads):
        peer = measure_peer(folder, tuple(sorted({*options.sizes, *options.mixed_sizes})),
                            options)
    with tempfile.TemporaryDirectory() as tmp:
        recipes = write_recipes(Path(tmp) / "recipes.yaml", options.steps)
        with serve_mesh(recipes, options.out / "serve.log") as served, phase("mesh", loads):
            mesh = asyncio.run(measure_mesh(served.base_url, options))
    result = report(options, peer, ceilings, mesh, loads)
    write_json(options.out / "throughput.json", result)
    chart(result, options.out / "throughput.png", options)
    log.info("results in %s\n%s", options.out, result["table"])
