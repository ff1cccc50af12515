"""`stagemesh bench replicas`: the same burst of image requests on one DiT replica and on two.

Both arms run `stagemesh serve` with one torch thread per stage ($STAGEMESH_THREADS=1) and the
DiT at `max_batch: 1`, so the comparison is replicas, not batching: with one replica the
burst's denoising runs one request after another, with two the gateway spreads it over both.
Each arm sends `--rounds` bursts of `--concurrency` requests (after one warm-up request) and
keeps the median wall time of a burst; the speed-up is one replica's median over two's. The
DiT metrics of every replica (`stagemesh_steps_total`, read through GET /v1/stages) show which
replicas did the work. A machine with fewer free cores than replicas cannot show the speed-up:
the report gives the load average it ran under. `--size` sets the image side (32 px by
default); `--vae-replicas` gives both arms that many VAE replicas, since at larger sizes the
burst's last decodes queue on the one-thread VAE after both DiT replicas finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
from pathlib import Path
from typing import Any

import httpx

from stagemesh.bench.common import (
    BarGroup,
    Stopwatch,
    machine_info,
    metric_value,
    parse_metrics,
    serve_mesh,
    write_bar_chart,
    write_json,
)

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0
# Placeholder ports: serve's --stage-ports auto (bench.common.serve_mesh) moves each replica
# to a free port and keeps the number of replicas the address lists.
RECIPE_TEMPLATE = """\
recipes:
  - name: replicas
    task: text-to-image
    model: builtin:tiny-shapes
    stages:
      tokenizer: {{address: "127.0.0.1:1", metrics_port: 1}}
      dit: {{address: "{dit}", metrics_port: 2,
            options: {{max_batch: 1, max_steps: 1000}}}}
      vae: {{address: "{vae}", metrics_port: 3}}
    defaults: {{width: {size}, height: {size}, num_inference_steps: {steps},
               true_cfg_scale: 4.0, negative_prompt: ""}}
"""


def _target(port: int, replicas: int) -> str:
    """A placeholder address naming `replicas` replicas (serve moves them to free ports)."""
    if replicas == 1:
        return f"127.0.0.1:{port}"
    return "ipv4:" + ",".join(f"127.0.0.1:{port + 10 * i}" for i in range(replicas))


async def _image(client: httpx.AsyncClient, base_url: str, seed: int) -> float:
    clock = Stopwatch()
    response = await client.post(f"{base_url}/v1/images/generations",
                                 json={"prompt": "a red circle on the left", "seed": seed})
    response.raise_for_status()
    return clock.elapsed()


async def _bursts(base_url: str, concurrency: int, rounds: int) -> list[float]:
    """Wall seconds of each burst of `concurrency` requests sent at once."""
    walls = []
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        await _image(client, base_url, seed=0)  # warm-up: first-call costs stay out
        for round_index in range(rounds):
            clock = Stopwatch()
            await asyncio.gather(*(_image(client, base_url, seed=round_index * 100 + i)
                                   for i in range(concurrency)))
            walls.append(clock.elapsed())
    return walls


def _dit_steps(base_url: str) -> dict[str, float]:
    """Each DiT replica's stagemesh_steps_total, by replica address."""
    stages = httpx.get(f"{base_url}/v1/stages", timeout=10).json()["stages"]
    steps = {}
    for stage in stages:
        if stage["name"] == "dit" and stage.get("metricsUrl", stage.get("metrics_url")):
            url = stage.get("metricsUrl") or stage["metrics_url"]
            samples = parse_metrics(httpx.get(url, timeout=10).text)
            steps[stage["address"]] = metric_value(samples, "stagemesh_steps_total", stage="dit")
    return steps


def _arm(replicas: int, options: argparse.Namespace) -> dict[str, Any]:
    recipe = options.out / f"recipe-{replicas}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(RECIPE_TEMPLATE.format(
        dit=_target(2, replicas), vae=_target(3, options.vae_replicas), steps=options.steps,
        size=options.size))
    with serve_mesh(recipe, options.out / f"serve-{replicas}.log",
                    env={"STAGEMESH_THREADS": "1"}) as mesh:
        walls = asyncio.run(_bursts(mesh.base_url, options.concurrency, options.rounds))
        steps = _dit_steps(mesh.base_url)
    log.info("%d DiT replica(s): burst walls %s s; DiT steps by replica %s", replicas,
             [round(w, 2) for w in walls], steps)
    return {"replicas": replicas, "burst_seconds": walls,
            "median_burst_seconds": statistics.median(walls), "dit_steps_by_replica": steps}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="stagemesh bench replicas", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="denoise steps per image")
    parser.add_argument("--size", type=int, default=32,
                        help="image side in pixels (tiny-shapes draws at 32; 256 makes the VAE "
                             "and the DiT's step a larger share of a request)")
    parser.add_argument("--vae-replicas", type=int, default=1,
                        help="VAE replicas in both arms: the last images of a burst finish "
                             "together on two DiT replicas and queue on a one-thread VAE (at "
                             "256 px, 16 steps, a decode costs ~1/8 of a denoise); 2 takes "
                             "that tail out of the DiT comparison")
    parser.add_argument("--out", type=Path, default=Path("bench-results/replicas"))
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    before = machine_info()
    one, two = _arm(1, options), _arm(2, options)
    speedup = one["median_burst_seconds"] / two["median_burst_seconds"]
    result = {"concurrency": options.concurrency, "steps": options.steps, "size": options.size,
              "vae_replicas": options.vae_replicas,
              "rounds": options.rounds, "one_replica": one, "two_replicas": two,
              "speedup": speedup, "machine_before": before, "machine_after": machine_info()}
    write_json(options.out / "replicas.json", result)
    write_bar_chart(options.out / "replicas.png", [BarGroup(
        title=f"{options.concurrency} concurrent {options.size}px images, {options.steps} steps, "
              "max_batch 1",
        ylabel="median burst wall time (s)", categories=["1 DiT replica", "2 DiT replicas"],
        series={"wall": [one["median_burst_seconds"], two["median_burst_seconds"]]},
        labels=["", f"{speedup:.2f}x"])], suptitle="stagemesh bench replicas")
    log.info("speed-up of 2 DiT replicas over 1: %.2fx (wrote %s)", speedup, options.out)
