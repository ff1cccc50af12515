"""`stagemesh bench peer`: one request at a time, the mesh against stock diffusers, alternating.

What a newcomer compares first: one image from `stagemesh serve` (REST -> Tokenizer -> DiT ->
VAE, one process per stage, at its defaults) against one image from stock diffusers
`QwenImagePipeline` in this process at its own default threads, on the same model folder
(`builtin:qwen-image-bench`), prompt, size, steps, guidance (true CFG 4 with an empty negative
prompt) and seed. After one warm-up request each, `repeats` requests alternate mesh / diffusers,
so that drift in the machine's load hits both sides alike; each side's latency is the median.

Reported: both medians, their ratio (mesh / diffusers: below 1 the mesh is faster; batched CFG
runs a request's two guidance rows in one forward), every latency, the machine's load average
before and after, and whether the two images are pixel-equal within 1 (they are the same
computation) — with float32 stages: on a CPU with native bfloat16 the VAE stage decodes in
bfloat16 by default (its faster dtype there), which moves a few pixels by a few levels;
`--float32-vae` sets its dtype to float32 for the exact comparison. JSON + PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import statistics
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from stagemesh.bench.common import (
    BarGroup,
    interrupt_on_sigterm,
    machine_info,
    markdown_table,
    serve_mesh,
    write_bar_chart,
    write_json,
)
from stagemesh.bench.throughput import (
    generate_image,
    load_peer,
    peer_image,
    phase,
    prepare_model,
    write_recipes,
)

if TYPE_CHECKING:  # diffusers loads only when the benchmark runs
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
    from PIL.Image import Image

log = logging.getLogger(__name__)

#: The two images are the same computation; PNG rounding may differ by one level.
MAX_PIXEL_DIFF = 1


@dataclass(frozen=True)
class Options:
    size: int
    steps: int
    repeats: int
    seed: int
    float32_vae: bool
    out: Path


@dataclass
class Alternation:
    """The latencies of each side, in the order they ran, and the last images."""

    mesh_s: list[float]
    peer_s: list[float]
    max_pixel_diff: int


async def alternate(base_url: str, pipe: QwenImagePipeline, options: Options) -> Alternation:
    """A warm-up request each, then `repeats` pairs: one mesh request, one diffusers request.

    The peer computes on a worker thread (this event loop only waits for it), at the torch
    threads of this process; the mesh's stages idle meanwhile, as the peer idles during a mesh
    request."""
    size, steps, seed = options.size, options.steps, options.seed
    async with httpx.AsyncClient(base_url=base_url) as client:
        await generate_image(client, size, seed, steps)
        await asyncio.to_thread(peer_image, pipe, size, steps, seed)
        mesh_s: list[float] = []
        peer_s: list[float] = []
        for repeat in range(options.repeats):
            seconds, png = await generate_image(client, size, seed, steps)
            mesh_s.append(seconds)
            seconds, image = await asyncio.to_thread(peer_image, pipe, size, steps, seed)
            peer_s.append(seconds)
            log.info("pair %d: mesh %.3f s, diffusers %.3f s", repeat + 1, mesh_s[-1], seconds)
    return Alternation(mesh_s, peer_s, pixel_diff(png, image))


def pixel_diff(png: bytes, image: Image) -> int:
    """The largest difference of one RGB channel between the mesh's PNG and the peer's image."""
    import numpy as np
    from PIL import Image as PILImage

    mesh = np.asarray(PILImage.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    peer = np.asarray(image.convert("RGB"), dtype=np.int16)
    if mesh.shape != peer.shape:
        raise RuntimeError(f"the mesh's image is {mesh.shape}, diffusers' {peer.shape}")
    return int(np.abs(mesh - peer).max())


def report(options: Options, run: Alternation, threads: int,
           loads: dict[str, list[float]]) -> dict[str, Any]:
    mesh, peer = statistics.median(run.mesh_s), statistics.median(run.peer_s)
    ratio = mesh / peer
    table = markdown_table(
        ["setting", "diffusers (in-process)", "mesh (REST, 3 stages)", "mesh / diffusers",
         "max pixel diff"],
        [[f"{options.size}px, {options.steps} steps, median of {options.repeats}",
          f"{peer:.3f} s", f"{mesh:.3f} s", f"{ratio:.3f}x", str(run.max_pixel_diff)]])
    return {"when": datetime.now(UTC).isoformat(),
            "machine": {**machine_info(), "load_average_by_phase": loads},
            "options": {key: str(value) for key, value in asdict(options).items()},
            "peer_torch_threads": threads,
            "mesh_median_s": mesh, "peer_median_s": peer,
            "latency_ratio_mesh_over_peer": ratio,
            "mesh_s": run.mesh_s, "peer_s": run.peer_s,
            "max_pixel_diff": run.max_pixel_diff,
            "pixels_equal_within_1": run.max_pixel_diff <= MAX_PIXEL_DIFF,
            "table": table}


def chart(result: dict[str, Any], path: Path, options: Options) -> Path:
    pairs = len(result["mesh_s"])
    categories = [f"pair {i + 1}" for i in range(pairs)] + ["median"]
    mesh = [*result["mesh_s"], result["mesh_median_s"]]
    peer = [*result["peer_s"], result["peer_median_s"]]
    panel = BarGroup(
        title=f"{options.size}px, {options.steps} steps, one request at a time: seconds",
        ylabel="seconds", categories=categories,
        series={"diffusers (in-process)": peer, "mesh": mesh},
        labels=[f"{m / p:.2f}x" for m, p in zip(mesh, peer, strict=True)])
    return write_bar_chart(path, [panel], suptitle="stagemesh bench peer (mesh / diffusers)")


def parse(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="stagemesh bench peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256, help="pixels per side")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="alternating pairs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--float32-vae", action="store_true",
                        help="the VAE stage in float32 (else its default dtype, bfloat16 on a "
                             "CPU with native bfloat16): pixels then match within 1")
    parser.add_argument("--out", default="bench-results/peer")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return Options(size=args.size, steps=args.steps, repeats=args.repeats, seed=args.seed,
                   float32_vae=args.float32_vae, out=Path(args.out))


def main(argv: list[str]) -> None:
    import torch

    options = parse(argv)
    interrupt_on_sigterm()
    folder = prepare_model()
    pipe = load_peer(folder)
    loads: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        recipes = write_recipes(Path(tmp) / "recipes.yaml", options.steps,
                                "float32" if options.float32_vae else None)
        with serve_mesh(recipes, options.out / "serve.log") as served, \
                phase("alternating", loads):
            run = asyncio.run(alternate(served.base_url, pipe, options))
    result = report(options, run, torch.get_num_threads(), loads)
    write_json(options.out / "peer.json", result)
    chart(result, options.out / "peer.png", options)
    log.info("results in %s\n%s", options.out, result["table"])
