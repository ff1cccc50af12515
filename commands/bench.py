"""`stagemesh bench NAME [OPTIONS]`: a benchmark (JSON + PNG); NAME: a module of bench/."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

from stagemesh.commands import Command


def bench_names() -> list[str]:
    """Every benchmark: each module of bench/ except its shared helpers."""
    from stagemesh import bench

    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name != "common")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", choices=bench_names())
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")


def _run(args: argparse.Namespace) -> None:
    importlib.import_module(f"stagemesh.bench.{args.which}").main(args.rest)


BENCH = Command("bench", "benchmarks (not tests)", _add_arguments, _run)
