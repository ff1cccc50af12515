"""`stagemesh bench throughput`: the mesh against stock diffusers, on the same cores, at scale.

Every number comes from one run, from three measurements that never overlap (each would steal
the other's cores):

1. **peer** — stock `diffusers.QwenImagePipeline` in this process at its own default threads (what
   a user runs instead of the mesh), on the same model folder, prompt, seed, steps and guidance:
   the latency of one image per size. Serving c requests one after another takes c times that;
2. **ceiling** — the raw batching gain of the model itself: one transformer forward of
   2c rows (c requests x cond/uncond) against 2c forwards of one row, best of 3, for every
   size and concurrency c > 1, in a child process that runs as the DiT stage does (its thread
   count, OpenMP wait policy and malloc thresholds, see `stagemesh.shared.process`);
3. **mesh** — `stagemesh serve` at its defaults on the benchmark recipe: bursts of c
   simultaneous requests per size (and mixed sizes), then staggered arrivals (Poisson) at a few
   offered loads, as fractions of the mesh's measured burst throughput.

Same-size bursts are measured in **paired rounds**: just before each burst, on the same thread,
one peer image of that size and (c > 1) one ceiling probe, so that the three numbers a round
compares see the same machine. On a shared machine whose speed drifts by 20% within minutes,
phases measured minutes apart compare the drift, not the systems; a round's share of the ceiling
does not. The DiT stage's mean step time during each burst (its metrics) is recorded beside the
ceiling's batched forward: it tells whether a gap is in the DiT or around it.

Reported: images/s, p50/p99 latency, the mesh's speed-up over the peer serving the same burst
serially, that speed-up as a share of the ceiling (medians over the rounds), and for mixed sizes
each size's p99 against its p99 under same-size load at the same concurrency (starvation shows
there). The machine's load average is recorded around every phase: other work on the machine
skews every number.
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
    metric_value,
    scrape,
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
    """c requests sent at once: their latencies, the wall time until the last finished, and (a
    same-size burst) what its round measured beside it."""

    sizes: list[int]
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    #: The DiT stage's mean step call during the burst (from its metrics).
    dit_step_s: float | None = None
    #: The peer's seconds for one image of this size, measured just before the burst.
    peer_s: float | None = None
    #: The ceiling probe measured just before the burst (c > 1).
    ceiling: dict[str, float] | None = None

    @property
    def images_per_s(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0

    @property
    def speedup(self) -> float | None:
        """Over the peer serving the burst's requests one after another (same round)."""
        return len(self.sizes) * self.peer_s / self.wall if self.peer_s and self.wall else None

    @property
    def ceiling_share(self) -> float | None:
        speedup = self.speedup
        return speedup / self.ceiling["speedup"] if speedup and self.ceiling else None


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


def measure_peer(pipe: QwenImagePipeline, sizes: tuple[int, ...], options: Options,
                 repeats: int = 2) -> dict[int, float]:
    """Median seconds per image of stock diffusers at its default threads, per size."""
    result = {}
    for size in sizes:
        peer_image(pipe, size, options.steps, 0)  # warm-up: allocator, kernels
        result[size] = statistics.median(
            peer_image(pipe, size, options.steps, seed, options.prompt(seed))[0]
            for seed in range(1, repeats + 1))
        log.info("peer: %dpx %.2f s/image", size, result[size])
    return result


class CeilingProbe:
    """Measures the raw batching gain on demand, in a child process set up like the DiT stage
    (see `_as_the_dit_stage`) so that this process's OpenMP state (the peer's) does not skew
    it. The child loads the transformer once and sleeps between probes."""

    def __init__(self, folder: Path) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch loaded
        self._child = ProcessPoolExecutor(1, mp_context=context, initializer=_as_the_dit_stage,
                                          initargs=(folder,))
        self._child.submit(int).result()  # start it (and load the model) now, not mid-phase

    def measure(self, size: int, c: int) -> dict[str, float]:
        """The `<size>px c=<c>` ceiling: 2c rows in one forward against 2c one-row forwards."""
        return self._child.submit(_ceiling_in_child, size, 2 * c).result()

    def __enter__(self) -> CeilingProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self._child.shutdown()


#: The ceiling child's transformer, loaded once by `_as_the_dit_stage`.
_child_transformer: QwenImageTransformer2DModel | None = None


def _as_the_dit_stage(folder: Path) -> None:
    """The ceiling child's set-up: before torch loads, the DiT stage's thread count, OpenMP wait
    policy and malloc thresholds; then the transformer."""
    from stagemesh.shared.process import keep_freed_memory, quiet_openmp_waits, stage_threads

    quiet_openmp_waits()
    keep_freed_memory()
    import torch
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    torch.set_num_threads(stage_threads("dit"))
    global _child_transformer
    _child_transformer = QwenImageTransformer2DModel.from_pretrained(
        folder, subfolder="transformer", local_files_only=True).eval()
    log.info("ceiling: %d torch threads, OMP_WAIT_POLICY=%s", torch.get_num_threads(),
             os.environ.get("OMP_WAIT_POLICY"))


def _ceiling_in_child(size: int, rows: int) -> dict[str, float]:
    if _child_transformer is None:
        raise RuntimeError("the ceiling child has no transformer: its initializer did not run")
    return measure_ceiling(_child_transformer, size, rows)


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


@dataclass
class Baselines:
    """What a same-size burst is compared against, measured on this (the main) thread just
    before the burst: the peer at its defaults runs here, as a user's script would."""

    peer: QwenImagePipeline
    ceiling: CeilingProbe
    options: Options

    def measure(self, size: int, c: int, round_index: int
                ) -> tuple[float, dict[str, float] | None]:
        """Seconds for one peer image of `size`, and (c > 1) the `size`/`c` ceiling probe."""
        seed = round_index + 1
        peer_s = peer_image(self.peer, size, self.options.steps, seed,
                            self.options.prompt(seed))[0]
        return peer_s, self.ceiling.measure(size, c) if c > 1 else None


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


async def dit_metrics_url(client: httpx.AsyncClient) -> str:
    """Where the benchmark recipe's DiT stage serves its metrics (GET /v1/stages)."""
    response = await client.get("/v1/stages")
    response.raise_for_status()
    return next(str(stage["metrics_url"]) for stage in response.json()["stages"]
                if stage["name"] == "dit" and stage["recipe"] == RECIPE_NAME)


async def measured_burst(client: httpx.AsyncClient, sizes: list[int], options: Options,
                         dit_metrics: str) -> Burst:
    """A burst, with the DiT stage's mean step call during it."""
    before = await scrape(client, dit_metrics)
    result = await burst(client, sizes, options)
    after = await scrape(client, dit_metrics)

    def delta(name: str) -> float:
        return (metric_value(after, name, stage="dit")
                - metric_value(before, name, stage="dit"))

    steps = delta("stagemesh_step_seconds_count")
    result.dit_step_s = delta("stagemesh_step_seconds_sum") / steps if steps else None
    return result


def measure_mesh(base_url: str, options: Options, baselines: Baselines) -> dict[str, Any]:
    """Every burst and staggered load against the running mesh. One event loop serves all the
    requests; between same-size bursts it is idle while `baselines` measures the peer and the
    ceiling on this thread (see the module docstring: paired rounds)."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    client = httpx.AsyncClient(base_url=base_url, limits=limits)
    with asyncio.Runner() as loop:
        try:
            return _measure_mesh(loop, client, options, baselines)
        finally:
            loop.run(client.aclose())


def _measure_mesh(loop: asyncio.Runner, client: httpx.AsyncClient, options: Options,
                  baselines: Baselines) -> dict[str, Any]:
    c_max = max(options.concurrency)
    dit_metrics = loop.run(dit_metrics_url(client))
    # Warm-up: allocator and kernels at every batch size the first measured burst uses.
    loop.run(burst(client, [options.sizes[0]] * c_max, options))
    bursts: dict[str, list[Burst]] = {}
    for size in sorted({*options.sizes, *options.mixed_sizes}):
        for c in options.concurrency:
            key = f"{size}px c={c}"
            bursts[key] = []
            for round_index in range(options.rounds):
                peer_s, ceiling = baselines.measure(size, c, round_index)
                measured = loop.run(measured_burst(client, [size] * c, options, dit_metrics))
                measured.peer_s, measured.ceiling = peer_s, ceiling
                bursts[key].append(measured)
                log.info("mesh %s round %d: %.2f images/s, wall %.2f s (peer %.2f s/image: "
                         "%.2fx), DiT step %.3f s (ceiling's batched forward %s), "
                         "of ceiling %s", key, round_index, measured.images_per_s,
                         measured.wall, measured.peer_s or 0.0, measured.speedup or 0.0,
                         measured.dit_step_s or 0.0,
                         f"{measured.ceiling['batched_s']:.3f} s" if measured.ceiling else "-",
                         f"{measured.ceiling_share:.0%}" if measured.ceiling_share else "-")
    if options.mixed_sizes:
        mixed = [options.mixed_sizes[i % len(options.mixed_sizes)] for i in range(c_max)]
        bursts[f"mixed c={c_max}"] = [loop.run(burst(client, mixed, options))
                                      for _ in range(options.rounds)]
    staggered: dict[str, Burst] = {}
    size = options.sizes[0]
    capacity = max(b.images_per_s for b in bursts[f"{size}px c={c_max}"])
    rng = random.Random(0)
    for load in options.loads:
        staggered[f"{size}px load={load:.0%}"] = loop.run(poisson(
            client, size, load * capacity, options.poisson_requests, options, rng))
    return {"bursts": bursts, "staggered": staggered, "capacity_images_per_s": capacity}


# -- report -------------------------------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(options: Options, peer: dict[int, float], mesh: dict[str, Any],
           loads: dict[str, list[float]]) -> dict[str, Any]:
    """Medians over rounds; a paired round's speed-up and share use its own peer and ceiling,
    an unpaired burst (mixed sizes) the peer phase's."""
    rows, summary = [], {}
    for key, runs in mesh["bursts"].items():
        sizes = runs[0].sizes
        c = len(sizes)
        latencies = [x for run in runs for x in run.latencies]
        wall = statistics.median(run.wall for run in runs)
        paired_peer = _median([run.peer_s for run in runs])
        peer_serial = (c * paired_peer if paired_peer is not None
                       else sum(peer.get(s, 0.0) for s in sizes))
        speedup = _median([run.speedup for run in runs]) or (
            peer_serial / wall if peer_serial else float("nan"))
        share = _median([run.ceiling_share for run in runs])
        dit_step = _median([run.dit_step_s for run in runs])
        ceiling_forward = _median([run.ceiling["batched_s"] if run.ceiling else None
                                   for run in runs])
        stats = summarize(latencies)
        by_size = {str(s): summarize([lat for run in runs
                                      for lat, sz in zip(run.latencies, run.sizes, strict=True)
                                      if sz == s]) for s in sorted(set(sizes))}
        summary[key] = {
            "c": c, "images_per_s": c / wall, "wall_s": wall, "latency": stats,
            "latency_by_size": by_size, "peer_serial_s": peer_serial,
            "speedup_over_peer_serial": speedup, "ceiling_share": share,
            "dit_step_s": dit_step, "ceiling_batched_forward_s": ceiling_forward,
            "rounds": [{"wall_s": run.wall, "peer_s": run.peer_s, "speedup": run.speedup,
                        "ceiling": run.ceiling, "ceiling_share": run.ceiling_share,
                        "dit_step_s": run.dit_step_s} for run in runs]}
        rows.append([key, f"{c / wall:.2f}", f"{stats['p50']:.2f}", f"{stats['p99']:.2f}",
                     f"{peer_serial:.2f}", f"{speedup:.2f}x",
                     "" if share is None else f"{share:.0%}",
                     "" if dit_step is None or ceiling_forward is None
                     else f"{dit_step:.3f} / {ceiling_forward:.3f}"])
    for key, run in mesh["staggered"].items():
        stats = summarize(run.latencies)
        summary[key] = {"images_per_s": run.images_per_s, "latency": stats}
        rows.append([key, f"{run.images_per_s:.2f}", f"{stats['p50']:.2f}",
                     f"{stats['p99']:.2f}", "", "", "", ""])
    table = markdown_table(["load", "images/s", "p50 s", "p99 s", "diffusers serial s",
                            "speed-up", "of ceiling", "DiT step / ceiling forward s"], rows)
    mixed = mixed_sizes_p99(summary)
    if mixed:
        table += "\n\n" + markdown_table(
            ["mixed sizes", "p99 s mixed", "p99 s same size", "ratio"],
            [[key, f"{m['mixed_p99']:.2f}", f"{m['same_size_p99']:.2f}", f"{m['ratio']:.2f}x"]
             for key, m in mixed.items()])
    return {"when": datetime.now(UTC).isoformat(),
            "machine": {**machine_info(), "load_average_by_phase": loads},
            "options": {k: str(v) for k, v in asdict(options).items()},
            "peer_seconds_per_image": peer,
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
    with CeilingProbe(folder) as ceiling:
        with phase("peer", loads):
            pipe = load_peer(folder)
            peer = measure_peer(pipe, tuple(sorted({*options.sizes, *options.mixed_sizes})),
                                options)
        with tempfile.TemporaryDirectory() as tmp:
            recipes = write_recipes(Path(tmp) / "recipes.yaml", options.steps)
            with serve_mesh(recipes, options.out / "serve.log") as served, phase("mesh", loads):
                mesh = measure_mesh(served.base_url, options, Baselines(pipe, ceiling, options))
    result = report(options, peer, mesh, loads)
    write_json(options.out / "throughput.json", result)
    chart(result, options.out / "throughput.png", options)
    log.info("results in %s\n%s", options.out, result["table"])
