"""`stagemesh bench parallel`: one DiT on one rank against the same DiT over a group of ranks.

On a CPU this compares 1 rank x N threads with N ranks x 1 thread (`parallel_cfg: 2`,
`parallel_ulysses: 2`), on the same cores, one guided request at a time at one size. No gain is
expected on a machine of two cores: the group's point here is to be correct (its results equal
one device's within 1e-5, see tests/model/test_dit_parallel.py), and this shows what the
collectives cost. On several GPUs the same arms are the question: `stagemesh bench gpu` has
them (its parallel arms, on the real-size model).

Arms run one after another in this process (it is rank 0 of each group in turn: one
torch.distributed group at a time), each timed best of `--rounds` after a warm-up request.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from stagemesh.bench.common import (
    BarGroup,
    machine_info,
    markdown_table,
    write_bar_chart,
    write_json,
)
from stagemesh.bench.dtypes import run_request
from stagemesh.models.registry import resolve_model
from stagemesh.services.dit.parallel import Degrees, QwenImageFamily, running_group
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.tokenizer.base import PromptInput
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter

log = logging.getLogger(__name__)

PROMPT = "a red circle on the left"
#: The arms: name -> group degrees (1 x 1: one rank with every thread).
ARMS = {"one-rank": Degrees(), "cfg2": Degrees(cfg=2), "ulysses2": Degrees(ulysses=2)}


def time_arm(model: Path, degrees: Degrees, payload: DenoiseInput, threads: int,
             rounds: int) -> float:
    """Best seconds per request with the DiT on `degrees` ranks sharing `threads` threads."""
    torch.set_num_threads(threads)  # a group gives each rank its share (start_group)
    adapter = DenoiseAdapter(model)
    if degrees.world == 1:
        return best_of(lambda: run_request(adapter, payload), rounds)
    with running_group(QwenImageFamily(adapter.transformer), model, degrees) as adapter.group:
        return best_of(lambda: run_request(adapter, payload), rounds)


def best_of(work: Callable[[], object], rounds: int) -> float:
    work()  # warm-up: first-call allocations, the group's first collectives
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench parallel", description=__doc__)
    parser.add_argument("--model", default="builtin:tiny-shapes")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="threads of all ranks together")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument("--out", default="bench-results/parallel")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    arms = [arm for arm in args.arms.split(",") if arm]
    if unknown := sorted(set(arms) - set(ARMS)):
        raise SystemExit(f"unknown arms {unknown}; known: {list(ARMS)}")
    model = resolve_model(args.model)
    encoder = PromptEncoderAdapter(model)
    embeddings = run_request(encoder, PromptInput(PROMPT, negative_prompt=""))
    payload = DenoiseInput(embeddings, args.size, args.size, args.steps, 4.0, seed=0)
    results = {arm: time_arm(model, ARMS[arm], payload, args.threads, args.rounds)
               for arm in arms}
    report = {"benchmark": "parallel", "created": datetime.now(UTC).isoformat(),
              "machine": machine_info(), "model": args.model, "size": args.size,
              "steps": args.steps, "threads": args.threads, "rounds": args.rounds,
              "seconds_per_request": results}
    base = results.get("one-rank")
    rows = [[arm, f"{ARMS[arm].world} x {max(1, args.threads // ARMS[arm].world)}",
             f"{seconds * 1000:.0f} ms", f"{base / seconds:.2f}x" if base else "-"]
            for arm, seconds in results.items()]
    report["table"] = markdown_table(["arm", "ranks x threads", "per request", "speed-up"], rows)
    path = write_json(Path(args.out) / "parallel.json", report)
    write_bar_chart(Path(args.out) / "parallel.png", [BarGroup(
        f"one guided request, {args.size} px, {args.steps} steps (best of {args.rounds})",
        "ms per request", list(results), {"ms": [s * 1000 for s in results.values()]},
        [row[3] for row in rows])], suptitle=f"stagemesh bench parallel ({args.model})")
    log.info("results:\n%s", report["table"])
    log.info("wrote %s and parallel.png", path)
