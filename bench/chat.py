"""`stagemesh bench chat`: time to first token, time to first audio and tokens/s of spoken chat
answers (`/v1/chat/completions`, `stream: true`, `modalities: ["text", "audio"]`), at several
concurrency levels.

Every number comes from one run of one mesh (`stagemesh serve` with only the embedded chat
recipe and the speech recipe it names, on free ports). For each concurrency level c, `rounds`
rounds of c requests are sent at once, each asking the same question (greedy decoding, so every
answer is the same length and the comparison is fair):

- TTFT: from sending the request to the first text (transcript) delta;
- time to first audio: from sending to the first audio data delta (the first sentence spoken
  while the thinker keeps writing);
- tokens/s per request: completion tokens / (end - first token), the decode rate one user sees;
- aggregate tokens/s: every completion token of the level / the level's wall time (what
  continuous batching buys).

`--text-only` asks for text alone: the thinker without the speech stages competing for the
same cores (TTFT is then the first `content` delta, and there is no first audio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from stagemesh.bench.common import (
    BarGroup,
    Stopwatch,
    machine_info,
    markdown_table,
    recipe_file_with_companions,
    serve_mesh,
    summarize,
    write_bar_chart,
    write_json,
)

log = logging.getLogger(__name__)

RECIPE_NAME = "smollm2"
QUESTION = "Tell me three facts about the sea, one sentence each."


@dataclass(frozen=True)
class Sample:
    ttft: float
    first_audio: float
    latency: float
    tokens: int

    @property
    def tokens_per_second(self) -> float:
        decode = self.latency - self.ttft
        return self.tokens / decode if decode > 0 else 0.0


@dataclass(frozen=True)
class Level:
    samples: list[Sample]
    wall: float

    @property
    def aggregate_tokens_per_second(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall


async def one_request(client: httpx.AsyncClient, max_tokens: int, spoken: bool) -> Sample:
    body: dict[str, object] = {
        "model": RECIPE_NAME, "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if spoken:
        body |= {"modalities": ["text", "audio"],
                 "audio": {"voice": "default", "format": "pcm16"}}
    clock = Stopwatch()
    ttft = first_audio = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat request failed: {response.status_code} "
                               f"{(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"chat stream failed: {chunk['error']}")
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            audio = delta.get("audio") or {}
            if ttft is None and (audio.get("transcript") or delta.get("content")):
                ttft = clock.elapsed()
            if first_audio is None and audio.get("data"):
                first_audio = clock.elapsed()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = clock.elapsed()
    return Sample(ttft=ttft or latency, first_audio=first_audio or 0.0, latency=latency,
                  tokens=tokens)


async def run_level(base_url: str, concurrency: int, rounds: int, max_tokens: int,
                    spoken: bool) -> Level:
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    clock = Stopwatch()
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        for _ in range(rounds):
            samples += await asyncio.gather(*(one_request(client, max_tokens, spoken)
                                              for _ in range(concurrency)))
    return Level(samples, clock.elapsed())


def level_report(level: Level) -> dict[str, Any]:
    samples = level.samples
    return {"ttft_s": summarize([s.ttft for s in samples]),
            "first_audio_s": summarize([s.first_audio for s in samples]),
            "latency_s": summarize([s.latency for s in samples]),
            "tokens_per_s": summarize([s.tokens_per_second for s in samples]),
            "aggregate_tokens_per_s": level.aggregate_tokens_per_second,
            "completion_tokens": samples[0].tokens if samples else 0}


async def measure(base_url: str, levels: list[int], rounds: int, max_tokens: int,
                  spoken: bool) -> dict[str, Any]:
    await run_level(base_url, 1, 1, max_tokens, spoken)  # warm-up: first-call costs stay out
    results: dict[str, Any] = {}
    for concurrency in levels:
        report = level_report(await run_level(base_url, concurrency, rounds, max_tokens,
                                              spoken))
        results[f"c{concurrency}"] = {"concurrency": concurrency, **report}
        log.info("c=%d: TTFT p50 %.3f s, first audio p50 %.3f s, %.1f tokens/s per request, "
                 "%.1f aggregate", concurrency, report["ttft_s"]["p50"],
                 report["first_audio_s"]["p50"], report["tokens_per_s"]["p50"],
                 report["aggregate_tokens_per_s"])
    return results


def table(results: dict[str, Any]) -> str:
    rows = [[r["concurrency"], f"{r['ttft_s']['p50']:.3f}", f"{r['ttft_s']['p99']:.3f}",
             f"{r['first_audio_s']['p50']:.3f}", f"{r['first_audio_s']['p99']:.3f}",
             f"{r['latency_s']['p50']:.2f}", f"{r['tokens_per_s']['p50']:.1f}",
             f"{r['aggregate_tokens_per_s']:.1f}"] for r in results.values()]
    return markdown_table(["concurrency", "TTFT p50 s", "TTFT p99 s", "first audio p50 s",
                           "first audio p99 s", "latency p50 s", "tokens/s per request p50",
                           "tokens/s aggregate"], rows)


def chart(path: Path, results: dict[str, Any], levels: list[int], title: str) -> Path:
    categories = [f"c={c}" for c in levels]
    rows = [results[f"c{c}"] for c in levels]
    return write_bar_chart(path, [
        BarGroup("Time to first token / first audio (p50)", "seconds", categories, {
            "first token": [r["ttft_s"]["p50"] for r in rows],
            "first audio": [r["first_audio_s"]["p50"] for r in rows]}),
        BarGroup("Tokens per second", "tokens/s", categories, {
            "per request (p50)": [r["tokens_per_s"]["p50"] for r in rows],
            "aggregate": [r["aggregate_tokens_per_s"] for r in rows]}),
    ], suptitle=title)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: concurrency 1 and 2, one round, 24 tokens")
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per level")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--text-only", action="store_true",
                        help="answers in text only (the thinker alone: no first-audio column)")
    parser.add_argument("--out", default="bench-results/chat", help="folder for JSON + PNG")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    levels = [int(c) for c in args.concurrency.split(",")]
    rounds, max_tokens = args.rounds, args.max_tokens
    if args.quick:
        levels, rounds, max_tokens = [1, 2], 1, 24
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        recipes = recipe_file_with_companions(Path(tmp) / "recipes.yaml", RECIPE_NAME)
        with serve_mesh(recipes, out / "serve.log") as mesh:
            results = asyncio.run(measure(mesh.base_url, levels, rounds, max_tokens,
                                          spoken=not args.text_only))
    report = {"benchmark": "chat", "created": datetime.now(UTC).isoformat(),
              "machine": machine_info(), "recipe": RECIPE_NAME, "question": QUESTION,
              "max_tokens": max_tokens, "rounds": rounds, "levels": levels,
              "spoken": not args.text_only,
              "results": results}
    json_path = write_json(out / "chat.json", report)
    png_path = chart(out / "chat.png", results, levels,
                     f"stagemesh bench chat — {RECIPE_NAME}, {max_tokens} tokens/answer, "
                     + ("text only" if args.text_only else "spoken"))
    log.info("results:\n%s", table(results))
    log.info("wrote %s and %s", json_path, png_path)
