"""`stagemesh bench startup`: how long `stagemesh serve` takes from its start to the first 200 of
`GET /health` (every stage of every recipe serving), with the stages forked from one launcher
that imported torch, diffusers and transformers once (the default) against every stage importing
them on its own (`STAGEMESH_STAGE_LAUNCHER=spawn`).

The two ways alternate round by round, and which goes first alternates too, so the page cache
and the machine's drift favour neither; the report is each way's median and their ratio. The
recipes are a file's (default: the embedded default recipes, the mesh `make serve` starts).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stagemesh.bench.common import (
    BarGroup,
    Stopwatch,
    machine_info,
    markdown_table,
    serve_mesh,
    summarize,
    write_bar_chart,
    write_json,
)
from stagemesh.gateway.recipes import DEFAULT_RECIPES
from stagemesh.launcher.client import LAUNCHER_ENV

log = logging.getLogger(__name__)

#: Each way of starting stages: the value of $STAGEMESH_STAGE_LAUNCHER it runs under.
WAYS = {"launcher (fork)": "fork", "spawn (own imports)": "spawn"}


@dataclass(frozen=True)
class Options:
    recipes: Path
    rounds: int
    out: Path


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(prog="stagemesh bench startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", type=Path, default=DEFAULT_RECIPES,
                        help="recipe file to serve (default: the embedded default recipes)")
    parser.add_argument("--rounds", type=int, default=3, help="starts of each way")
    parser.add_argument("--out", type=Path, default=Path("bench-results/startup"))
    options = parser.parse_args(list(argv))
    if options.rounds < 1:
        parser.error("--rounds: at least 1")
    return Options(options.recipes, options.rounds, options.out)


def time_to_health(recipes: Path, launcher: str, log_path: Path) -> float:
    """Seconds from starting `serve` to its first 200 of /health (the mesh is stopped after)."""
    stopwatch = Stopwatch()
    with serve_mesh(recipes, log_path, env={LAUNCHER_ENV: launcher}):
        return stopwatch.elapsed()


def round_order(index: int) -> list[str]:
    """The ways in round `index`: the first way goes first in even rounds, last in odd ones."""
    ways = list(WAYS)
    return ways if index % 2 == 0 else ways[::-1]


def report(options: Options, seconds: dict[str, list[float]], machine_before: dict[str, Any],
           machine_after: dict[str, Any]) -> dict[str, Any]:
    medians = {way: statistics.median(values) for way, values in seconds.items()}
    launcher, spawn = list(WAYS)
    rows = [[way, len(values), f"{medians[way]:.1f}", f"{min(values):.1f}",
             f"{max(values):.1f}"] for way, values in seconds.items()]
    return {
        "benchmark": "startup", "created": datetime.now(UTC).isoformat(),
        "machine": {"start": machine_before, "end": machine_after},
        "options": {"recipes": str(options.recipes), "rounds": options.rounds,
                    "out": str(options.out)},
        "seconds": seconds, "summary": {way: summarize(v) for way, v in seconds.items()},
        "spawn_over_launcher": medians[spawn] / medians[launcher],
        "table": markdown_table(["stages start by", "starts", "p50 s to /health 200", "min s",
                                 "max s"], rows),
    }


def main(argv: list[str]) -> None:
    options = parse(argv)
    machine_before = machine_info()
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for index in range(options.rounds):
        for way in round_order(index):
            elapsed = time_to_health(options.recipes, WAYS[way], options.out / "serve.log")
            seconds[way].append(elapsed)
            log.info("round %d %s: %.1f s to /health 200", index, way, elapsed)
    result = report(options, seconds, machine_before, machine_info())
    write_json(options.out / "startup.json", result)
    write_bar_chart(options.out / "startup.png", [BarGroup(
        "serve -> GET /health 200 (median)", "seconds", list(seconds),
        {"p50": [statistics.median(v) for v in seconds.values()]},
        [f"{statistics.median(v):.1f} s" for v in seconds.values()])],
        suptitle=f"stagemesh bench startup ({options.recipes.name}, {options.rounds} rounds)")
    log.info("results in %s (spawn / launcher: %.2fx)\n%s", options.out,
             result["spawn_over_launcher"], result["table"])
