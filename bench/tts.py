"""`stagemesh bench tts`: time to first audio packet (TTFP), real-time factor (RTF) and
end-to-end latency of text-to-speech, streaming vs one-shot, at several concurrency levels.

Every number comes from one run of one mesh (`stagemesh serve` with only the measured speech
recipe, on free ports): by default the default voice (`piper-joe`: Piper's joe voice on ONNX
Runtime, z frames streamed sentence by sentence), or `--recipe csm-tiny` (the autoregressive
example). For each mode and concurrency level c, `rounds` rounds of c requests are sent at once:

- TTFP: from sending the request to the first audio bytes (past the WAV header). One-shot
  responses arrive whole, so their TTFP is their latency;
- end-to-end latency: from sending to the last byte;
- RTF: end-to-end latency / seconds of audio returned (< 1 means faster than real time).

The Piper voice speaks the whole text (the same text and seeds every run, so the same audio
length). csm-tiny has random weights, so every request runs to `max_new_tokens` frames: audio
length is fixed and the comparison is fair.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import struct
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

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

log = logging.getLogger(__name__)

TEXT = "The quick brown fox jumps over the lazy dog."
WAV_HEADER_BYTES = 44
SAMPLE_BYTES = 2  # mono int16
MODES = ("stream", "one-shot")


@dataclass(frozen=True)
class Profile:
    """How a recipe is asked: its voice, and the frame cap (None: speak the whole text)."""

    voice: str
    max_new_tokens: int | None


#: The recipes the bench knows; the first is the default.
PROFILES = {"piper-joe": Profile(voice="default", max_new_tokens=None),
            "csm-tiny": Profile(voice="vivian", max_new_tokens=50)}


@dataclass(frozen=True)
class Sample:
    ttfp: float
    latency: float
    audio_seconds: float

    @property
    def rtf(self) -> float:
        return self.latency / self.audio_seconds


def speech_recipes(path: Path, name: str) -> Path:
    """A recipe file with only the measured speech recipe (no other stages to start)."""
    document = yaml.safe_load(DEFAULT_RECIPES.read_text())
    recipes = [r for r in document["recipes"] if r["name"] == name]
    path.write_text(yaml.safe_dump({"recipes": recipes}))
    return path


@dataclass(frozen=True)
class Ask:
    """One level's requests: which recipe, how, and whether streamed."""

    recipe: str
    profile: Profile
    stream: bool

    def body(self, seed: int) -> dict[str, object]:
        body: dict[str, object] = {"model": self.recipe, "voice": self.profile.voice,
                                   "input": TEXT, "seed": seed, "stream": self.stream}
        if self.profile.max_new_tokens is not None:
            body["max_new_tokens"] = self.profile.max_new_tokens
        return body


async def one_request(client: httpx.AsyncClient, ask: Ask, seed: int) -> Sample:
    clock = Stopwatch()
    ttfp, received = None, b""
    async with client.stream("POST", "/v1/audio/speech", json=ask.body(seed)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"speech request failed: {response.status_code} "
                               f"{(await response.aread())[:300]!r}")
        async for chunk in response.aiter_bytes():
            received += chunk
            if ttfp is None and len(received) > WAV_HEADER_BYTES:
                ttfp = clock.elapsed()
    latency = clock.elapsed()
    (rate,) = struct.unpack("<I", received[24:28])  # the WAV header's sample rate
    return Sample(ttfp=ttfp if ttfp is not None else latency, latency=latency,
                  audio_seconds=(len(received) - WAV_HEADER_BYTES) / (rate * SAMPLE_BYTES))


async def run_level(base_url: str, ask: Ask, concurrency: int, rounds: int) -> list[Sample]:
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        for round_index in range(rounds):
            samples += await asyncio.gather(*(
                one_request(client, ask, seed=1000 * round_index + i)
                for i in range(concurrency)))
    return samples


def level_report(samples: list[Sample]) -> dict[str, Any]:
    return {"ttfp_s": summarize([s.ttfp for s in samples]),
            "latency_s": summarize([s.latency for s in samples]),
            "rtf": summarize([s.rtf for s in samples]),
            "audio_seconds": samples[0].audio_seconds if samples else 0.0}


async def measure(base_url: str, recipe: str, profile: Profile, levels: list[int],
                  rounds: int) -> dict[str, Any]:
    # warm-up: first-call costs stay out
    await run_level(base_url, Ask(recipe, profile, stream=True), 1, 1)
    results: dict[str, Any] = {}
    for mode in MODES:
        for concurrency in levels:
            samples = await run_level(base_url, Ask(recipe, profile, mode == "stream"),
                                      concurrency, rounds)
            results[f"{mode}/c{concurrency}"] = {"mode": mode, "concurrency": concurrency,
                                                 **level_report(samples)}
            log.info("%s c=%d: TTFP p50 %.3f s, RTF p50 %.3f", mode, concurrency,
                     results[f"{mode}/c{concurrency}"]["ttfp_s"]["p50"],
                     results[f"{mode}/c{concurrency}"]["rtf"]["p50"])
    return results


def table(results: dict[str, Any]) -> str:
    rows = [[r["mode"], r["concurrency"], f"{r['ttfp_s']['p50']:.3f}", f"{r['ttfp_s']['p99']:.3f}",
             f"{r['latency_s']['p50']:.3f}", f"{r['latency_s']['p99']:.3f}",
             f"{r['rtf']['p50']:.3f}", f"{r['rtf']['p99']:.3f}"] for r in results.values()]
    return markdown_table(["mode", "concurrency", "TTFP p50 s", "TTFP p99 s", "latency p50 s",
                           "latency p99 s", "RTF p50", "RTF p99"], rows)


def chart(path: Path, results: dict[str, Any], levels: list[int], title: str) -> Path:
    categories = [f"c={c}" for c in levels]

    def series(metric: str) -> dict[str, list[float]]:
        return {mode: [results[f"{mode}/c{c}"][metric]["p50"] for c in levels] for mode in MODES}

    return write_bar_chart(path, [
        BarGroup("TTFP (p50)", "seconds", categories, series("ttfp_s")),
        BarGroup("End-to-end latency (p50)", "seconds", categories, series("latency_s")),
        BarGroup("Real-time factor (p50, lower is better)", "RTF", categories, series("rtf")),
    ], suptitle=title)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench tts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=next(iter(PROFILES)), choices=list(PROFILES),
                        help="the speech recipe to measure (default: the default voice)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: concurrency 1 and 2, one round (csm-tiny: 13 frames)")
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per level")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="frames per request (csm-tiny: 12.5 per second of audio, default "
                             "50; piper-joe: 86.1 per second, default the whole text)")
    parser.add_argument("--out", default="bench-results/tts", help="folder for JSON + PNG")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    levels = [int(c) for c in args.concurrency.split(",")]
    rounds, recipe = args.rounds, args.recipe
    profile = PROFILES[recipe]
    if args.max_new_tokens is not None:
        profile = Profile(profile.voice, args.max_new_tokens)
    if args.quick:
        levels, rounds = [1, 2], 1
        if profile.max_new_tokens is not None:
            profile = Profile(profile.voice, 13)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        recipes = speech_recipes(Path(tmp) / "recipes.yaml", recipe)
        with serve_mesh(recipes, out / "serve.log") as mesh:
            results = asyncio.run(measure(mesh.base_url, recipe, profile, levels, rounds))
    frames = profile.max_new_tokens
    report = {"benchmark": "tts", "created": datetime.now(UTC).isoformat(),
              "machine": machine_info(), "recipe": recipe, "text": TEXT,
              "max_new_tokens": frames, "rounds": rounds, "levels": levels,
              "results": results}
    json_path = write_json(out / f"tts-{recipe}.json", report)
    length = "the whole text" if frames is None else f"{frames} frames/request"
    png_path = chart(out / f"tts-{recipe}.png", results, levels,
                     f"stagemesh bench tts — {recipe}, {length}")
    log.info("results:\n%s", table(results))
    log.info("wrote %s and %s", json_path, png_path)
