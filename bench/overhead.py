"""`stagemesh bench overhead`: what one request costs in the gateway and the mesh's event loops,
on uvloop and on asyncio's default loop, measured side by side.

Two `stagemesh serve` meshes run at once, the same embedded `tiny-shapes` recipe on free ports:
one with STAGEMESH_UVLOOP=1 (the gateway and every stage on uvloop), one with STAGEMESH_UVLOOP=0.
The benchmark client (httpx, on asyncio in this process: the same client for both) sends, in
rounds that alternate which mesh goes first, so drift in the machine's load hits both alike:

- `models`: GET /v1/models — the gateway's HTTP path alone (uvicorn, Starlette, middleware);
- `image`: a small image request (32x32, two denoise steps) through the gateway and the
  tokenizer, DiT and VAE stages: HTTP, three gRPC stage streams, each stage's engine thread
  handing events to its loop. The model compute in it is the same in both meshes, so the
  difference between the two is the loops' share of the round trip.

Each at concurrency 1 (one request after another) and at a higher concurrency. It reports
round-trip p50 / p99 per mesh and the uvloop / asyncio ratio; JSON + PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from stagemesh.bench.common import (
    BarGroup,
    machine_info,
    markdown_table,
    serve_mesh,
    summarize,
    write_bar_chart,
    write_json,
)
from stagemesh.bench.tts import speech_recipes as single_recipe_file

log = logging.getLogger(__name__)

RECIPE = "tiny-shapes"
#: The mesh each loop setting runs, by the STAGEMESH_UVLOOP value it is started with.
LOOPS = {"uvloop": "1", "asyncio": "0"}
IMAGE_BODY = {"prompt": "a red circle", "size": "32x32", "num_inference_steps": 2}
WARMUP_REQUESTS = 5

#: One request of a workload: (client, index) -> awaitable response.
Send = Callable[[httpx.AsyncClient, int], Awaitable[httpx.Response]]


def _models(client: httpx.AsyncClient, index: int) -> Awaitable[httpx.Response]:
    return client.get("/v1/models")


def _image(client: httpx.AsyncClient, index: int) -> Awaitable[httpx.Response]:
    return client.post("/v1/images/generations", json={**IMAGE_BODY, "seed": index})


WORKLOADS: dict[str, Send] = {"models": _models, "image": _image}


@dataclass(frozen=True)
class Level:
    workload: str
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.workload}/c{self.concurrency}"


async def _timed(client: httpx.AsyncClient, send: Send, index: int) -> float:
    started = time.perf_counter()
    response = await send(client, index)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url} answered {response.status_code}: "
                           f"{response.text[:300]}")
    return elapsed


async def run_level(client: httpx.AsyncClient, level: Level, requests: int) -> list[float]:
    """`requests` round trips, `level.concurrency` in flight at a time."""
    send = WORKLOADS[level.workload]
    latencies: list[float] = []
    for first in range(0, requests, level.concurrency):
        batch = range(first, min(requests, first + level.concurrency))
        latencies += await asyncio.gather(*(_timed(client, send, i) for i in batch))
    return latencies


async def measure(base_urls: dict[str, str], levels: list[Level], requests: int,
                  rounds: int) -> dict[str, dict[str, list[float]]]:
    """Latencies per loop and level, rounds alternating which mesh goes first."""
    latencies: dict[str, dict[str, list[float]]] = {
        loop: {level.key: [] for level in levels} for loop in base_urls}
    limits = httpx.Limits(max_connections=max(level.concurrency for level in levels) + 2)
    async with contextlib.AsyncExitStack() as stack:
        clients = {loop: await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=120, limits=limits))
            for loop, url in base_urls.items()}
        for loop, client in clients.items():  # first-call costs stay out
            for level in levels:
                await run_level(client, level, WARMUP_REQUESTS)
            log.info("%s mesh warmed up", loop)
        for round_index in range(rounds):
            order = list(clients) if round_index % 2 == 0 else list(reversed(clients))
            for level in levels:
                for loop in order:
                    latencies[loop][level.key] += await run_level(clients[loop], level, requests)
            log.info("round %d/%d done", round_index + 1, rounds)
    return latencies


def report(latencies: dict[str, dict[str, list[float]]], levels: list[Level]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for level in levels:
        stats = {loop: summarize(latencies[loop][level.key]) for loop in latencies}
        results[level.key] = {
            "workload": level.workload, "concurrency": level.concurrency, **stats,
            "p50_ratio_uvloop_over_asyncio": stats["uvloop"]["p50"] / stats["asyncio"]["p50"],
            "p99_ratio_uvloop_over_asyncio": stats["uvloop"]["p99"] / stats["asyncio"]["p99"]}
    return results


def table(results: dict[str, Any]) -> str:
    rows = [[r["workload"], r["concurrency"], r["uvloop"]["n"],
             f"{1000 * r['uvloop']['p50']:.2f} / {1000 * r['uvloop']['p99']:.2f}",
             f"{1000 * r['asyncio']['p50']:.2f} / {1000 * r['asyncio']['p99']:.2f}",
             f"{r['p50_ratio_uvloop_over_asyncio']:.2f}x",
             f"{r['p99_ratio_uvloop_over_asyncio']:.2f}x"] for r in results.values()]
    return markdown_table(["workload", "concurrency", "requests per loop",
                           "uvloop p50 / p99 ms", "asyncio p50 / p99 ms",
                           "p50 uvloop/asyncio", "p99 uvloop/asyncio"], rows)


def chart(path: Path, results: dict[str, Any], title: str) -> Path:
    categories = list(results)

    def series(stat: str) -> dict[str, list[float]]:
        return {loop: [1000 * results[key][loop][stat] for key in categories] for loop in LOOPS}

    return write_bar_chart(path, [
        BarGroup("Round trip p50", "milliseconds", categories, series("p50")),
        BarGroup("Round trip p99", "milliseconds", categories, series("p99")),
    ], suptitle=title)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100,
                        help="requests per level, loop and round (default 100)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 requests, 1 round")
    parser.add_argument("--out", default="bench-results/overhead", help="folder for JSON + PNG")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    requests, rounds = (10, 1) if args.quick else (args.requests, args.rounds)
    levels = [Level(workload, int(c)) for workload in WORKLOADS
              for c in args.concurrency.split(",")]
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as meshes:
        recipes = single_recipe_file(Path(tmp) / "recipes.yaml", RECIPE)
        base_urls = {loop: meshes.enter_context(serve_mesh(
            recipes, out / f"serve-{loop}.log", env={"STAGEMESH_UVLOOP": value})).base_url
            for loop, value in LOOPS.items()}
        latencies = asyncio.run(measure(base_urls, levels, requests, rounds))
    results = report(latencies, levels)
    document = {"benchmark": "overhead", "created": datetime.now(UTC).isoformat(),
                "machine": machine_info(), "recipe": RECIPE, "image_request": IMAGE_BODY,
                "requests_per_level_loop_round": requests, "rounds": rounds,
                "results": results}
    json_path = write_json(out / "overhead.json", document)
    png_path = chart(out / "overhead.png", results,
                     f"stagemesh bench overhead — round trip, uvloop vs asyncio "
                     f"({rounds} rounds x {requests} requests)")
    log.info("results:\n%s", table(results))
    log.info("wrote %s and %s", json_path, png_path)
