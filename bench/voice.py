"""`stagemesh bench voice`: a spoken conversation over `GET /v1/realtime`, timed the way a user
hears it: from the last voiced sample of a question to the first audio of its answer.

One mesh (`stagemesh serve` with the chat recipe, the speech recipe it speaks through and the
listener it hears with). Questions are recorded once in our own voice (the mesh's Piper, 24 kHz
PCM16) and replayed by c sessions at once (c = 1 and 4 by default; `--rounds` fresh sessions one
after another per slot, 3 by default), each through a microphone that never stops: 100 ms
chunks in real time, silence between questions, each chunk sent once its 100 ms have been
"recorded" (as a real microphone can), with server VAD on (silence_duration_ms 500). Every
server event is timed as it arrives (a task reads the socket all the time).
Per answer, from the client's clock:

- VAD wait: last voiced sample -> `input_audio_buffer.speech_stopped` (includes the 500 ms of
  silence the client asked for, and the microphone's chunking);
- transcription: speech_stopped -> `...input_audio_transcription.completed`;
- thinker to first sentence: transcript -> the answer's first transcript delta, which the
  gateway sends as it hands the answer's first piece (its first clause or sentence) to the
  talker;
- talker + codec: that first transcript delta -> the first `response.output_audio.delta`
  (with the mesh's speculative end of turn, an answer starts at the pause and is held until
  the turn is confirmed, so these two are what was not yet done at the confirmation: near 0
  when the held answer already had its first audio);
- total: last voiced sample -> first audio (p50, p99); the four phases add up to it;
- barge-in: our voice talks over a long answer 0.5 s after its first audio; the time from
  `speech_started` to the last audio delta received (<= 0: nothing came after it);
- transcription real-time factor: the listener's time for a recorded question / its duration.

Where the time goes, in units that do not depend on the machine's load (per turn, and summed
up per level):

- `vad_lag_ms`: audio from the last voiced sample to where the listener says the pause began
  (`speech_stopped.audio_end_ms`); the turn ends `silence_duration_ms` of audio after that, and
  the VAD wait is that plus the microphone's chunking and one step;
- `first_piece` and `first_piece_tokens`: the answer's first spoken piece (the first transcript
  delta) and its length in thinker tokens (the thinker's own tokenizer): what the thinker
  writes before the talker starts;
- `speculative_answers` / `answers_at_confirmation`, `speculations_dropped` and
  `speculation_lead_s_mean` (the gateway's /metrics, before and after the level): how many
  turns' answers started at the pause (a held answer), and how much audio the session received
  between such an answer's start and its turn's confirmation (the thinker's head start);
  these count every turn of the level (the barge-in's question and interruption too).

The machine's load average is recorded before and after (other work skews every timing).
`--dry-run` checks the report and the chart with made-up samples, starting nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import itertools
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from stagemesh.bench.common import (
    BarGroup,
    machine_info,
    markdown_table,
    metric_value,
    parse_metrics,
    recipe_file_with_companions,
    serve_mesh,
    summarize,
    write_bar_chart,
    write_json,
)
from stagemesh.shared.resample import StreamResampler

log = logging.getLogger(__name__)

RECIPE_NAME = "smollm2"
RATE, CHUNK_S = 24_000, 0.1
SILENCE_MS = 500
QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?",
             "What colour is the sky on a clear day?")
LONG_QUESTION = "Tell me a long story about a ship on the sea, in ten sentences."
INTERRUPTION = "Wait, stop please."
BARGE_IN_AFTER_S = 0.5
#: A sample louder than this (of full scale) is voiced, for "the last voiced sample".
VOICED = 0.01
PHASES = ("vad_wait", "transcription", "thinker_first_sentence", "talker_codec", "total")

Pcm16 = npt.NDArray[np.int16]


@dataclass(frozen=True)
class Turn:
    """One answered question, in seconds (see the module docstring)."""

    vad_wait: float
    transcription: float
    thinker_first_sentence: float
    talker_codec: float
    total: float


@dataclass(frozen=True)
class TurnFacts:
    """What an answered question's time was made of, in load-independent units."""

    vad_lag_ms: int
    first_piece: str
    first_piece_tokens: int = 0  # filled in by the level's report


def record(client: httpx.Client, text: str) -> Pcm16:
    """`text` in our own voice, at 24 kHz."""
    wav = client.post("/v1/audio/speech", json={"input": text, "voice": "default",
                                                "response_format": "wav"})
    wav.raise_for_status()
    import soundfile

    pcm, rate = soundfile.read(io.BytesIO(wav.content), dtype="float32")
    resampled = StreamResampler(rate, RATE).push(np.asarray(pcm, np.float32), final=True)
    return np.round(np.clip(resampled, -1, 1) * 32767).astype(np.int16)


def last_voiced(pcm: Pcm16) -> int:
    """The index just after the last voiced sample of `pcm`."""
    loud = np.flatnonzero(np.abs(pcm.astype(np.float32)) > VOICED * 32767)
    return int(loud[-1]) + 1 if loud.size else 0


def transcription_rtf(client: httpx.Client, pcm: Pcm16) -> float:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, pcm, RATE, format="WAV", subtype="PCM_16")
    started = time.perf_counter()
    client.post("/v1/audio/transcriptions", files={"file": ("q.wav", out.getvalue())}
                ).raise_for_status()
    return (time.perf_counter() - started) / (int(pcm.shape[0]) / RATE)


class _Client:
    """One realtime session: a microphone that streams in real time, and every event, timed
    as it arrives."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._arrived = asyncio.Event()
        #: Audio to say, with the future of when its last voiced sample is spoken: the clock
        #: time, and the session audio's millisecond.
        self._speaking: asyncio.Queue[tuple[Pcm16, asyncio.Future[tuple[float, int]]]] = (
            asyncio.Queue())

    async def receive(self) -> None:
        async for message in self.socket:
            self.events.append((time.perf_counter(), json.loads(message)))
            self._arrived.set()

    async def microphone(self) -> None:
        """100 ms chunks in real time, each sent once its audio has been "recorded": what
        is queued to say, else silence."""
        size = int(RATE * CHUNK_S)
        pending = np.zeros(0, np.int16)
        started = time.perf_counter()
        for tick in itertools.count():
            at = tick * size  # the stream's sample where this chunk starts
            if not pending.size and not self._speaking.empty():
                pending, spoken = self._speaking.get_nowait()
                voiced = at + last_voiced(pending)
                spoken.set_result((started + voiced / RATE, voiced * 1000 // RATE))
            chunk = pending[:size] if pending.size else np.zeros(size, np.int16)
            pending = pending[size:]
            chunk = np.concatenate([chunk, np.zeros(size - chunk.shape[0], np.int16)])
            await asyncio.sleep(max(0.0, started + (tick + 1) * CHUNK_S - time.perf_counter()))
            await self.socket.send(json.dumps({"type": "input_audio_buffer.append",
                                               "audio": base64.b64encode(chunk.tobytes())
                                               .decode()}))

    async def say(self, pcm: Pcm16) -> tuple[float, int]:
        """Queue `pcm` for the microphone; the clock time and the session audio's millisecond
        of its last voiced sample (in the future while it is still being said)."""
        spoken: asyncio.Future[tuple[float, int]] = asyncio.get_running_loop().create_future()
        await self._speaking.put((pcm, spoken))
        return await spoken

    async def until(self, kind: str, after: int) -> tuple[int, float]:
        while True:
            for index in range(after, len(self.events)):
                if self.events[index][1]["type"] == kind:
                    return index, self.events[index][0]
            after = len(self.events)
            self._arrived.clear()
            await asyncio.wait_for(self._arrived.wait(), 120)

    async def ask(self, pcm: Pcm16) -> tuple[Turn, TurnFacts]:
        mark = len(self.events)
        voiced, voiced_ms = await self.say(pcm)
        stop, stopped = await self.until("input_audio_buffer.speech_stopped", mark)
        _, heard = await self.until(
            "conversation.item.input_audio_transcription.completed", mark)
        index, sentence = await self.until("response.output_audio_transcript.delta", mark)
        _, audio = await self.until("response.output_audio.delta", mark)
        await self.until("response.done", index)
        facts = TurnFacts(vad_lag_ms=int(self.events[stop][1]["audio_end_ms"]) - voiced_ms,
                          first_piece=str(self.events[index][1]["delta"]))
        return Turn(vad_wait=stopped - voiced, transcription=heard - stopped,
                    thinker_first_sentence=sentence - heard, talker_codec=audio - sentence,
                    total=audio - voiced), facts

    async def barge_in(self, question: Pcm16, interruption: Pcm16) -> float:
        """Talk over a long answer; seconds from speech_started to the last audio delta."""
        mark = len(self.events)
        await self.say(question)
        first, at = await self.until("response.output_audio.delta", mark)
        await asyncio.sleep(max(0.0, at + BARGE_IN_AFTER_S - time.perf_counter()))
        await self.say(interruption)
        started, heard_at = await self.until("input_audio_buffer.speech_started", first)
        done, _ = await self.until("response.done", started)
        deltas = [t for t, e in self.events[first:done]
                  if e["type"] == "response.output_audio.delta"]
        return max(deltas) - heard_at


async def session(base_url: str, questions: list[Pcm16], long: Pcm16,
                  interruption: Pcm16) -> tuple[list[tuple[Turn, TurnFacts]], float]:
    from websockets.asyncio.client import connect

    url = base_url.replace("http://", "ws://") + f"/v1/realtime?model={RECIPE_NAME}"
    async with connect(url, max_size=2**24) as socket:
        client = _Client(socket)
        receiving = asyncio.create_task(client.receive())
        await socket.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "max_output_tokens": 400, "audio": {"input": {
                "turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}}}}}))
        await client.until("session.updated", 0)
        microphone = asyncio.create_task(client.microphone())
        try:
            turns = [await client.ask(pcm) for pcm in questions]
            return turns, await client.barge_in(long, interruption)
        finally:
            for task in (microphone, receiving):
                task.cancel()


async def run_level(base_url: str, concurrency: int, rounds: int, questions: list[Pcm16],
                    long: Pcm16, interruption: Pcm16,
                    ) -> tuple[list[tuple[Turn, TurnFacts]], list[float]]:
    """`rounds` times, `concurrency` fresh sessions at once (a fresh history each round, so
    every round asks the same prompts: the rounds only add samples)."""
    results = []
    for _ in range(rounds):
        results += await asyncio.gather(*(session(base_url, questions, long, interruption)
                                          for _ in range(concurrency)))
    return [turn for turns, _ in results for turn in turns], [trail for _, trail in results]


#: The gateway's speculation metrics (gateway/realtime/speculation.py), by report key.
SPECULATION_METRICS = {
    "speculative_answers": ("stagemesh_realtime_turn_answers_total", {"speculative": "true"}),
    "answers_at_confirmation": ("stagemesh_realtime_turn_answers_total",
                                {"speculative": "false"}),
    "speculations_dropped": ("stagemesh_realtime_speculations_dropped_total", {}),
    "lead_sum": ("stagemesh_realtime_speculation_lead_seconds_sum", {}),
    "lead_count": ("stagemesh_realtime_speculation_lead_seconds_count", {}),
}


def speculation_counts(client: httpx.Client) -> dict[str, float]:
    response = client.get("/metrics")
    response.raise_for_status()
    samples = parse_metrics(response.text)
    return {key: metric_value(samples, name, recipe=RECIPE_NAME, **labels)
            for key, (name, labels) in SPECULATION_METRICS.items()}


def speculation_report(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {key: after[key] - before[key] for key in SPECULATION_METRICS}
    lead = delta.pop("lead_sum") / delta["lead_count"] if delta["lead_count"] else None
    del delta["lead_count"]
    return {**{key: int(value) for key, value in delta.items()}, "speculation_lead_s_mean": lead}


def level_report(concurrency: int, turns: list[tuple[Turn, TurnFacts]], trails: list[float],
                 speculation: dict[str, Any]) -> dict[str, Any]:
    timings = [asdict(turn) for turn, _ in turns]
    facts = [asdict(fact) for _, fact in turns]
    return {"concurrency": concurrency,
            **{phase: summarize([t[phase] for t in timings]) for phase in PHASES},
            "barge_in_last_delta_s": summarize(trails),
            "vad_lag_ms": summarize([f["vad_lag_ms"] for f in facts]),
            "first_piece_tokens": summarize([f["first_piece_tokens"] for f in facts]),
            **speculation,
            "turns": [{**t, **f} for t, f in zip(timings, facts, strict=True)]}


def dry_results(levels: list[int]) -> dict[str, Any]:
    """Made-up samples of the right shape (--dry-run)."""
    turn = (Turn(0.55, 0.2, 0.3, 0.1, 1.15), TurnFacts(40, "The capital of France", 4))
    counts = dict.fromkeys(SPECULATION_METRICS, 0.0)
    return {f"c{c}": level_report(c, [turn] * 3 * c, [0.0] * c,
                                  speculation_report(counts, counts)) for c in levels}


def with_token_counts(turns: list[tuple[Turn, TurnFacts]]) -> list[tuple[Turn, TurnFacts]]:
    """Each first piece's length in the thinker's tokens (its own tokenizer, from the model
    folder the mesh serves)."""
    from transformers import AutoTokenizer

    from stagemesh.models.smollm2 import ensure_smollm2

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    return [(turn, dataclasses.replace(facts, first_piece_tokens=len(tokenizer.encode(
        facts.first_piece, add_special_tokens=False)))) for turn, facts in turns]


def table(results: dict[str, Any]) -> str:
    rows = [[r["concurrency"], *(f"{r[p]['p50']:.3f}" for p in PHASES),
             f"{r['total']['p99']:.3f}", f"{r['barge_in_last_delta_s']['max']:.3f}",
             f"{r['vad_lag_ms']['p50']:.0f}", f"{r['first_piece_tokens']['p50']:.0f}",
             f"{r['speculative_answers']} of "
             f"{r['speculative_answers'] + r['answers_at_confirmation']}"]
            for r in results.values()]
    return markdown_table(["concurrency", *(f"{p} p50 s" for p in PHASES), "total p99 s",
                           "barge-in last delta max s", "VAD lag p50 ms",
                           "first piece tokens p50", "speculative answers"], rows)


def chart(path: Path, results: dict[str, Any], title: str) -> Path:
    categories = [f"c={r['concurrency']}" for r in results.values()]
    rows = list(results.values())
    return write_bar_chart(path, [
        BarGroup("Last voiced sample to first answer audio (p50)", "seconds", categories,
                 {phase: [r[phase]["p50"] for r in rows] for phase in PHASES}),
        BarGroup("Barge-in: speech_started to the last audio delta", "seconds", categories,
                 {"max": [r["barge_in_last_delta_s"]["max"] for r in rows]}),
    ], suptitle=title)


def measure(base_url: str, levels: list[int], rounds: int) -> tuple[dict[str, Any], float]:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        questions = [record(client, text) for text in QUESTIONS]
        long, interruption = record(client, LONG_QUESTION), record(client, INTERRUPTION)
        rtf = transcription_rtf(client, questions[0])
    results = {}
    for concurrency in levels:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            before = speculation_counts(client)
            turns, trails = asyncio.run(run_level(base_url, concurrency, rounds, questions,
                                                  long, interruption))
            speculation = speculation_report(before, speculation_counts(client))
        report = level_report(concurrency, with_token_counts(turns), trails, speculation)
        results[f"c{concurrency}"] = report
        log.info("c=%d: last voiced sample to first audio p50 %.3f s; %d of %d answers "
                 "speculative", concurrency, report["total"]["p50"],
                 report["speculative_answers"],
                 report["speculative_answers"] + report["answers_at_confirmation"])
    return results, rtf


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench voice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4", help="comma-separated session counts")
    parser.add_argument("--rounds", type=int, default=3,
                        help="sessions per concurrent slot, one after another (each asks every "
                             "question once): more samples for the percentiles")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the report and chart from made-up samples; start nothing")
    parser.add_argument("--out", default="bench-results/voice", help="folder for JSON + PNG")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    levels = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    load_before = machine_info()
    if args.dry_run:
        results, rtf = dry_results(levels), 0.0
    else:
        with tempfile.TemporaryDirectory() as tmp:
            recipes = recipe_file_with_companions(Path(tmp) / "recipes.yaml", RECIPE_NAME)
            with serve_mesh(recipes, out / "serve.log") as mesh:
                results, rtf = measure(mesh.base_url, levels, args.rounds)
    report = {"benchmark": "voice", "created": datetime.now(UTC).isoformat(),
              "dry_run": args.dry_run, "machine": load_before,
              "load_average_after": machine_info()["load_average"], "recipe": RECIPE_NAME,
              "questions": list(QUESTIONS), "silence_duration_ms": SILENCE_MS,
              "transcription_rtf": rtf, "levels": levels, "rounds": args.rounds,
              "results": results}
    json_path = write_json(out / "voice.json", report)
    png_path = chart(out / "voice.png", results,
                     f"stagemesh bench voice — {RECIPE_NAME}, realtime, server VAD "
                     f"{SILENCE_MS} ms" + (" (dry run)" if args.dry_run else ""))
    log.info("results:\n%s", table(results))
    log.info("wrote %s and %s", json_path, png_path)
