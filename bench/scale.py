"""`stagemesh bench scale`: accelerator-hours of whole-pipeline replicas against per-stage
autoscaling on queue depth, at the same p99 latency SLO, by discrete-event simulation (SimPy).

1. Stage costs are measured on the real services in this run: a `stagemesh serve` of the
   embedded recipes (tiny-shapes, csm-tiny) on free ports gets a few requests one at a time per
   image size and for speech, and each stage's own Prometheus histogram
   (`stagemesh_step_seconds`) says what its compute took: the tokenizer per prompt, the DiT per
   denoise step and the VAE per image (for each size), the talker per frame and the codec per
   decode step (with its measured frames per step).
2. Those costs drive a simulation of a mixed trace: images of every measured size and speech,
   an image-heavy period, a speech-heavy one, a burst, a quiet tail; 30 % of the requests are
   cancelled by their client at a random denoise step or frame (their work up to there is done
   and paid for; the later stages never see them).
3. Two ways to scale, with the same autoscaler (every `poll_s` it wants ceil(in-flight /
   threshold) replicas, in-flight = waiting + running; it acts at once upward, at most
   doubling per poll, and downward on the highest wish of the last `scale_down_window_s`; a
   new replica serves `start_lag_s` after it is asked for and costs from that moment):
   (a) whole-pipeline replicas: each replica holds every stage; one count for all stages, set
       by the stage that wants the most;
   (b) per-stage autoscaling: each stage has its own count (what k8s/ ships: one KEDA
       ScaledObject per stage on its queue).
   For each, a search finds the cheapest setting (threshold, minimum replicas per scaling unit)
   whose p99 latency, for images and for speech, is within the SLO; cost is
   accelerator-hours: the replica-hours of the stages that hold an accelerator (tokenizer,
   DiT, VAE, talker, as in the k8s gpu overlay; the codec runs on CPU).

Assumptions (also written into the JSON): a replica computes one request at a time at the cost
measured one at a time (no batching, in either arm); requests queue FIFO per stage and any
replica of a stage may take any request (the best a whole-pipeline deployment could route);
the codec starts when the talker is done (no streaming overlap); measured costs are scaled by
one factor so that a DiT step, averaged over the sizes, takes `dit_step_s` (the tiny models
take milliseconds; ratios between stages and sizes stay as measured); arrival rates are set in load
units (`load`: busy DiT replicas in the image phase, busy talker replicas in the speech
phase). A model, not a measurement of a cluster: read the ratio, not the hours.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import yaml

if TYPE_CHECKING:  # the `bench` extra: imported when a simulation runs, not with the module
    import simpy

from stagemesh.bench.common import (
    BarGroup,
    Samples,
    Stopwatch,
    interrupt_on_sigterm,
    machine_info,
    markdown_table,
    metric_value,
    percentile,
    scrape,
    serve_mesh,
    write_bar_chart,
    write_json,
)
from stagemesh.gateway.recipes import DEFAULT_RECIPES

log = logging.getLogger(__name__)

Task = Literal["image", "speech"]
TASKS: tuple[Task, ...] = ("image", "speech")
TASK_STAGES: dict[Task, tuple[str, ...]] = {
    "image": ("tokenizer", "dit", "vae"),
    "speech": ("talker", "codec"),
}
STAGES = (*TASK_STAGES["image"], *TASK_STAGES["speech"])
#: The stages that hold an accelerator (k8s/overlays/gpu): what accelerator-hours count.
ACCELERATOR_STAGES = frozenset({"tokenizer", "dit", "vae", "talker"})

IMAGE_RECIPE = "tiny-shapes"
SPEECH_RECIPE = "csm-tiny"
#: The embedded recipe whose stage is measured, per stage.
RECIPE_OF = {**dict.fromkeys(TASK_STAGES["image"], IMAGE_RECIPE),
             **dict.fromkeys(TASK_STAGES["speech"], SPEECH_RECIPE)}
PROMPT = "a red circle above a blue square"
SPEECH_TEXT = "The quick brown fox jumps over the lazy dog."
REQUEST_TIMEOUT_S = 300.0


# -- stage costs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one replica's compute per unit of work (one request at a time)."""

    tokenizer_s: float  # one prompt
    dit_step_s: Mapping[int, float]  # one denoise step, by image side
    vae_s: Mapping[int, float]  # one decode, by image side
    talker_frame_s: float  # one codec frame
    codec_chunk_s: float  # one decode step call, which decodes `chunk_frames` frames
    chunk_frames: int  # frames per codec step call, as measured

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.dit_step_s))

    @property
    def mean_dit_step_s(self) -> float:
        """A DiT step averaged over the sizes (the trace draws them uniformly)."""
        return sum(self.dit_step_s.values()) / len(self.dit_step_s)

    def scaled(self, factor: float) -> StageCosts:
        """Every cost times `factor` (ratios kept)."""
        return dataclasses.replace(
            self, tokenizer_s=self.tokenizer_s * factor,
            dit_step_s={s: c * factor for s, c in self.dit_step_s.items()},
            vae_s={s: c * factor for s, c in self.vae_s.items()},
            talker_frame_s=self.talker_frame_s * factor,
            codec_chunk_s=self.codec_chunk_s * factor)


# -- the trace ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One client request: `units` denoise steps (image) or frames (speech)."""

    arrival: float
    task: Task
    units: int
    size: int = 0  # image side; 0 for speech
    cancel_after: int | None = None  # units done when the client cancels; None: never


def visits(request: Request, costs: StageCosts) -> list[tuple[str, float]]:
    """The stages a request occupies, in order, with the seconds each computes for it. A
    cancelled request stops at its step (or frame) and never reaches the later stages."""
    done = request.units if request.cancel_after is None else request.cancel_after
    if request.task == "image":
        route = [("tokenizer", costs.tokenizer_s),
                 ("dit", done * costs.dit_step_s[request.size])]
        if request.cancel_after is None:
            route.append(("vae", costs.vae_s[request.size]))
        return route
    chunks = math.ceil(done / costs.chunk_frames)
    return [("talker", done * costs.talker_frame_s), ("codec", chunks * costs.codec_chunk_s)]


@dataclass(frozen=True)
class Phase:
    """A stretch of the trace: arrival rates in load units per task."""

    name: str
    seconds: float
    image: float  # 1.0 = enough images to keep `load` DiT replicas busy
    speech: float  # 1.0 = enough speech to keep `load` talker replicas busy


PHASES = (
    Phase("image-heavy", 300, image=1.0, speech=0.25),
    Phase("speech-heavy", 300, image=0.25, speech=1.0),
    Phase("burst", 120, image=3.0, speech=1.0),
    Phase("quiet", 300, image=0.3, speech=0.3),
)


@dataclass(frozen=True)
class TraceSpec:
    load: float = 4.0
    phases: tuple[Phase, ...] = PHASES
    steps: int = 16
    frames: tuple[int, int] = (25, 125)  # speech length range (12.5 frames per second)
    cancelled: float = 0.3
    seed: int = 0


def make_trace(spec: TraceSpec, costs: StageCosts) -> list[Request]:
    """Poisson arrivals per phase and task; sizes uniform; 30 % cancelled at a random unit."""
    rng = random.Random(spec.seed)
    mean_image_s = spec.steps * costs.mean_dit_step_s
    mean_speech_s = sum(spec.frames) / 2 * costs.talker_frame_s
    rate = {"image": spec.load / mean_image_s, "speech": spec.load / mean_speech_s}
    trace: list[Request] = []
    start = 0.0
    for phase in spec.phases:
        for task, level in (("image", phase.image), ("speech", phase.speech)):
            t = start
            while level > 0:
                t += rng.expovariate(rate[task] * level)
                if t >= start + phase.seconds:
                    break
                trace.append(_request(rng, spec, costs, task, t))
        start += phase.seconds
    return sorted(trace, key=lambda r: r.arrival)


def _request(rng: random.Random, spec: TraceSpec, costs: StageCosts, task: str,
             arrival: float) -> Request:
    if task == "image":
        units, size = spec.steps, rng.choice(costs.sizes)
    else:
        units, size = rng.randint(*spec.frames), 0
    cancel = rng.randrange(units) if rng.random() < spec.cancelled else None
    return Request(arrival, "image" if task == "image" else "speech", units, size, cancel)


# -- the simulation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """How replicas are counted and scaled."""

    per_stage: bool  # (b) each stage on its own; (a) one count for the whole pipeline
    threshold: float  # in-flight requests per replica the autoscaler aims at
    min_replicas: Mapping[str, int]  # per stage; whole-pipeline: the same for every stage
    max_replicas: int = 64
    start_lag_s: float = 45.0
    poll_s: float = 15.0
    scale_down_window_s: float = 300.0


_REPLICA = object()


class Pool:
    """The replicas of one stage and the FIFO queue in front of them."""

    def __init__(self, env: simpy.Environment, replicas: int) -> None:
        import simpy

        self.env = env
        self.idle = simpy.Store(env)
        self.total = 0  # replicas that exist and cost: starting, idle, busy, leaving
        self.starting = 0
        self.leaving = 0  # busy replicas that go once their request is done
        self.waiting = 0
        self.running = 0
        self._area = 0.0
        self._since = 0.0
        for _ in range(replicas):
            self._resize(+1)
            self.idle.put(_REPLICA)

    @property
    def active(self) -> int:
        """Replicas the autoscaler counts (the leaving ones are already gone for it)."""
        return self.total - self.leaving

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running

    def replica_seconds(self) -> float:
        self._resize(0)
        return self._area

    def _resize(self, delta: int) -> None:
        self._area += self.total * (self.env.now - self._since)
        self._since = self.env.now
        self.total += delta

    def visit(self, seconds: float) -> Generator[simpy.Event, object, float]:
        """Queue for a replica, compute `seconds` on it; returns the time spent queueing."""
        queued = self.env.now
        self.waiting += 1
        yield self.idle.get()
        self.waiting -= 1
        self.running += 1
        wait = self.env.now - queued
        yield self.env.timeout(seconds)
        self.running -= 1
        if self.leaving:
            self.leaving -= 1
            self._resize(-1)
        else:
            self.idle.put(_REPLICA)
        return wait

    def scale_to(self, wanted: int, start_lag_s: float) -> None:
        more = wanted - self.active
        if more > 0:
            kept = min(more, self.leaving)  # a leaving replica asked back just stays
            self.leaving -= kept
            for _ in range(more - kept):
                self._resize(+1)
                self.starting += 1
                self.env.process(self._start(start_lag_s))
        else:
            fewer = -more
            while fewer and self.idle.items:
                self.idle.items.pop()
                self._resize(-1)
                fewer -= 1
            busy = self.total - self.starting - len(self.idle.items) - self.leaving
            self.leaving += min(fewer, busy)

    def _start(self, lag: float) -> Generator[simpy.Event, object, None]:
        yield self.env.timeout(lag)
        self.starting -= 1
        self.idle.put(_REPLICA)


@dataclass
class Outcome:
    """What one simulated run cost and how fast it answered."""

    latencies: dict[Task, list[float]] = field(default_factory=lambda: {t: [] for t in TASKS})
    waits: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    replica_seconds: dict[str, float] = field(default_factory=dict)
    peak_replicas: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def accelerator_seconds(self) -> float:
        return sum(v for s, v in self.replica_seconds.items() if s in ACCELERATOR_STAGES)

    def p99(self, task: Task) -> float:
        values = self.latencies[task]
        return percentile(values, 99) if values else 0.0

    def p99s(self) -> dict[Task, float]:
        return {task: self.p99(task) for task in TASKS}

    def meets(self, slo: Mapping[Task, float]) -> bool:
        return all(self.p99(task) <= limit for task, limit in slo.items())


def simulate(trace: Sequence[Request], costs: StageCosts, policy: Policy) -> Outcome:
    """Run the trace through replicas scaled by `policy`; cost counted until the last request
    is answered (or the trace ends, if later)."""
    import simpy

    env = simpy.Environment()
    pools = {stage: Pool(env, policy.min_replicas[stage]) for stage in STAGES}
    outcome = Outcome()
    peaks = {stage: pool.total for stage, pool in pools.items()}
    done = [env.process(_serve(env, request, costs, pools, outcome)) for request in trace]
    env.process(_autoscale(env, pools, policy, peaks))
    env.run(until=env.all_of(done))
    end = max(env.now, trace[-1].arrival if trace else 0.0)
    if end > env.now:
        env.run(until=end)
    outcome.seconds = end
    outcome.replica_seconds = {stage: pool.replica_seconds() for stage, pool in pools.items()}
    outcome.peak_replicas = peaks
    return outcome


def _serve(env: simpy.Environment, request: Request, costs: StageCosts, pools: dict[str, Pool],
           outcome: Outcome) -> Generator[simpy.Event, object, None]:
    yield env.timeout(request.arrival - env.now)
    for stage, seconds in visits(request, costs):
        wait = yield env.process(pools[stage].visit(seconds))
        assert isinstance(wait, float)
        outcome.waits[stage].append(wait)
    if request.cancel_after is None:  # a cancelled request has no latency a client waits for
        outcome.latencies[request.task].append(env.now - request.arrival)


def wanted_replicas(pools: Mapping[str, Pool], policy: Policy) -> dict[str, int]:
    """What the autoscaler asks for now: per stage, or the most any stage wants for all."""
    wished = {stage: max(policy.min_replicas[stage],
                         min(policy.max_replicas, math.ceil(pool.in_flight / policy.threshold)))
              for stage, pool in pools.items()}
    if policy.per_stage:
        return wished
    return dict.fromkeys(pools, max(wished.values()))


def _autoscale(env: simpy.Environment, pools: dict[str, Pool], policy: Policy,
               peaks: dict[str, int]) -> Generator[simpy.Event, object, None]:
    history: deque[tuple[float, dict[str, int]]] = deque()
    while True:
        yield env.timeout(policy.poll_s)
        history.append((env.now, wanted_replicas(pools, policy)))
        while history[0][0] < env.now - policy.scale_down_window_s:
            history.popleft()
        for stage, pool in pools.items():
            target = max(wish[stage] for _, wish in history)  # down only as the window allows
            target = min(target, max(2 * pool.active, pool.active + 2))  # up: at most double
            pool.scale_to(target, policy.start_lag_s)
            peaks[stage] = max(peaks[stage], pool.total)


# -- the search: cheapest setting that holds the SLO ------------------------------------------


#: Autoscaler thresholds tried (in-flight requests per replica); infinity: no autoscaling, the
#: minimum is all there is (static provisioning is a candidate in both arms).
THRESHOLDS = (2.0, 8.0, math.inf)


@dataclass(frozen=True)
class Found:
    policy: Policy
    outcome: Outcome
    runs: int


def cheapest_whole(trace: Sequence[Request], costs: StageCosts, slo: Mapping[Task, float],
                   base: Policy) -> Found | None:
    """(a): for each threshold, the fewest minimum whole replicas that hold the SLO (found by
    bisection: more replicas never answer slower)."""
    best: Found | None = None
    runs = 0
    for threshold in THRESHOLDS:
        def run(replicas: int, threshold: float = threshold) -> Outcome:
            nonlocal runs
            runs += 1
            return simulate(trace, costs, dataclasses.replace(
                base, per_stage=False, threshold=threshold,
                min_replicas=dict.fromkeys(STAGES, replicas)))

        low, high = 1, base.max_replicas
        held = run(high)
        if not held.meets(slo):
            continue
        while low < high:  # invariant: `high` holds the SLO (its outcome: `held`)
            middle = (low + high) // 2
            outcome = run(middle)
            if outcome.meets(slo):
                high, held = middle, outcome
            else:
                low = middle + 1
        if best is None or held.accelerator_seconds < best.outcome.accelerator_seconds:
            best = Found(dataclasses.replace(base, per_stage=False, threshold=threshold,
                                             min_replicas=dict.fromkeys(STAGES, high)),
                         held, runs)
    return None if best is None else dataclasses.replace(best, runs=runs)


def cheapest_per_stage(trace: Sequence[Request], costs: StageCosts, slo: Mapping[Task, float],
                       base: Policy) -> Found | None:
    """(b): for each threshold, raise the minimum of the stage whose queue waits are worst,
    one replica at a time, until the SLO holds."""
    best: Found | None = None
    runs = 0
    for threshold in THRESHOLDS:
        minimum = dict.fromkeys(STAGES, 1)
        while max(minimum.values()) <= base.max_replicas:
            policy = dataclasses.replace(base, per_stage=True, threshold=threshold,
                                         min_replicas=dict(minimum))
            outcome = simulate(trace, costs, policy)
            runs += 1
            if outcome.meets(slo):
                if best is None or outcome.accelerator_seconds < best.outcome.accelerator_seconds:
                    best = Found(policy, outcome, runs)
                break
            minimum[_worst_stage(outcome, slo)] += 1
    return None if best is None else dataclasses.replace(best, runs=runs)


def _worst_stage(outcome: Outcome, slo: Mapping[Task, float]) -> str:
    """The stage with the longest p99 queue wait on a task that misses its SLO."""
    missing = [task for task, limit in slo.items() if outcome.p99(task) > limit]
    stages = [s for task in missing for s in TASK_STAGES[task]]
    return max(stages, key=lambda s: percentile(outcome.waits[s], 99) if outcome.waits[s] else 0)


def unloaded_p99(trace: Sequence[Request], costs: StageCosts) -> dict[Task, float]:
    """Each task's p99 latency with a replica free for every request (no queueing at all)."""
    everyone = max(1, len(trace))
    policy = Policy(True, 1.0, dict.fromkeys(STAGES, everyone), max_replicas=everyone)
    return simulate(trace, costs, policy).p99s()


# -- measuring the stage costs on the real services ---------------------------------------------


@dataclass(frozen=True)
class MeasureSpec:
    sizes: tuple[int, ...] = (32, 64, 128)
    steps: int = 16
    frames: int = 50
    repeats: int = 3


async def measure_costs(base_url: str, spec: MeasureSpec) -> StageCosts:
    """Requests one at a time through the gateway; each stage's step-time histogram (summed
    over its replicas) says what its compute took."""
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        urls = await _metrics_urls(client)
        await _image(client, spec.sizes[0], spec.steps, seed=0)  # warm-up: first-call costs
        await _speech(client, spec.frames, seed=0)
        dit_step, vae = {}, {}
        tokenizer: list[float] = []
        for size in spec.sizes:
            async with _delta(client, urls) as delta:
                for seed in range(spec.repeats):
                    await _image(client, size, spec.steps, seed)
            dit_step[size] = delta.mean("dit")
            vae[size] = delta.total("vae") / spec.repeats
            tokenizer.append(delta.total("tokenizer") / spec.repeats)
            log.info("%dpx: DiT step %.4f s, VAE %.4f s, tokenizer %.4f s", size,
                     dit_step[size], vae[size], tokenizer[-1])
        async with _delta(client, urls) as delta:
            for seed in range(spec.repeats):
                await _speech(client, spec.frames, seed)
        frames_per_call = delta.count("talker", "stagemesh_steps_total") / delta.calls("talker")
        chunks = delta.calls("codec") / spec.repeats
    costs = StageCosts(
        tokenizer_s=sum(tokenizer) / len(tokenizer), dit_step_s=dit_step, vae_s=vae,
        talker_frame_s=delta.mean("talker") / frames_per_call,
        codec_chunk_s=delta.total("codec") / max(chunks, 1.0),
        chunk_frames=max(1, round(spec.frames / max(chunks, 1.0))))
    log.info("speech: talker frame %.4f s, codec chunk %.4f s (%d frames)",
             costs.talker_frame_s, costs.codec_chunk_s, costs.chunk_frames)
    return costs


class _Delta:
    """Differences between two scrapes of every stage's /metrics."""

    def __init__(self) -> None:
        self.before: dict[str, list[Samples]] = {}
        self.after: dict[str, list[Samples]] = {}

    def count(self, stage: str, name: str) -> float:
        return sum(metric_value(after, name, stage=stage) - metric_value(before, name, stage=stage)
                   for before, after in zip(self.before[stage], self.after[stage], strict=True))

    def total(self, stage: str) -> float:
        """Seconds of step calls."""
        return self.count(stage, "stagemesh_step_seconds_sum")

    def calls(self, stage: str) -> float:
        return self.count(stage, "stagemesh_step_seconds_count")

    def mean(self, stage: str) -> float:
        calls = self.calls(stage)
        if not calls:
            raise RuntimeError(f"stage {stage} ran no step while it was measured")
        return self.total(stage) / calls


@contextlib.asynccontextmanager
async def _delta(client: httpx.AsyncClient,
                 urls: Mapping[str, list[str]]) -> AsyncIterator[_Delta]:
    delta = _Delta()
    delta.before = {s: [await scrape(client, u) for u in us] for s, us in urls.items()}
    yield delta
    delta.after = {s: [await scrape(client, u) for u in us] for s, us in urls.items()}


def _measured_recipes(folder: Path) -> Path:
    """A recipe file with only the two embedded recipes this benchmark measures."""
    document = yaml.safe_load(DEFAULT_RECIPES.read_text())
    keep = [r for r in document["recipes"] if r["name"] in RECIPE_OF.values()]
    path = folder / "recipes.yaml"
    path.write_text(yaml.safe_dump({"recipes": keep}))
    return path


async def _metrics_urls(client: httpx.AsyncClient) -> dict[str, list[str]]:
    """Every stage's /metrics URLs (one per replica), from GET /v1/stages."""
    response = await client.get("/v1/stages")
    response.raise_for_status()
    urls: dict[str, list[str]] = {stage: [] for stage in STAGES}
    for stage in response.json()["stages"]:
        name = stage.get("name")
        if RECIPE_OF.get(name) == stage.get("recipe") and stage.get("metrics_url"):
            urls[name].append(str(stage["metrics_url"]))
    missing = [stage for stage, found in urls.items() if not found]
    if missing:
        raise RuntimeError(f"GET /v1/stages lists no metrics URL for {missing}")
    return urls


async def _image(client: httpx.AsyncClient, size: int, steps: int, seed: int) -> None:
    body = {"model": IMAGE_RECIPE, "prompt": PROMPT, "size": f"{size}x{size}", "seed": seed,
            "num_inference_steps": steps}
    response = await client.post("/v1/images/generations", json=body)
    response.raise_for_status()


async def _speech(client: httpx.AsyncClient, frames: int, seed: int) -> None:
    body = {"model": SPEECH_RECIPE, "input": SPEECH_TEXT, "voice": "vivian", "seed": seed,
            "max_new_tokens": frames, "stream": False}
    response = await client.post("/v1/audio/speech", json=body)
    response.raise_for_status()


# -- the report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    out: Path
    load: float
    dit_step_s: float
    slo_factors: tuple[float, ...]
    lags: tuple[float, ...]
    seed: int
    measure: MeasureSpec
    costs: Path | None  # a previous scale.json whose measured costs to reuse


def compare(costs: StageCosts, trace: Sequence[Request], slo_factor: float,
            start_lag_s: float) -> dict[str, Any]:
    """Both arms' cheapest settings at the same SLO, and what per-stage scaling saves."""
    unloaded = unloaded_p99(trace, costs)
    slo = {task: slo_factor * p99 for task, p99 in unloaded.items()}
    base = Policy(True, 1.0, dict.fromkeys(STAGES, 1), start_lag_s=start_lag_s)
    whole = cheapest_whole(trace, costs, slo, base)
    per_stage = cheapest_per_stage(trace, costs, slo, base)
    row: dict[str, Any] = {"start_lag_s": start_lag_s, "slo_factor": slo_factor,
                           "slo_p99_s": slo, "unloaded_p99_s": unloaded,
                           "arms": {"whole-pipeline": _arm(whole), "per-stage": _arm(per_stage)}}
    if whole and per_stage:
        row["saving_pct"] = 100 * (1 - per_stage.outcome.accelerator_seconds
                                   / whole.outcome.accelerator_seconds)
    return row


def _threshold(value: float) -> float | str:
    """A threshold as JSON can hold it (infinity: no autoscaling)."""
    return "static" if math.isinf(value) else value


def _arm(found: Found | None) -> dict[str, Any] | None:
    if found is None:
        return None
    outcome = found.outcome
    return {
        "threshold": _threshold(found.policy.threshold),
        "min_replicas": dict(found.policy.min_replicas),
        "accelerator_hours": outcome.accelerator_seconds / 3600,
        "replica_hours": {s: v / 3600 for s, v in outcome.replica_seconds.items()},
        "peak_replicas": outcome.peak_replicas,
        "p99_s": outcome.p99s(),
        "simulated_s": outcome.seconds,
        "search_runs": found.runs,
    }


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for row in rows:
        whole, per = row["arms"]["whole-pipeline"], row["arms"]["per-stage"]
        lines.append([
            f"{row['start_lag_s']:.0f} s", f"{row['slo_factor']:g}x: " + " / ".join(
                f"{row['slo_p99_s'][t]:.1f}" for t in TASKS),
            _hours(whole), _hours(per),
            f"{row['saving_pct']:.0f} %" if "saving_pct" in row else "n/a",
            _setting(whole), _setting(per)])
    return markdown_table(["pod start lag", "SLO p99 image / speech (s)",
                           "accel-h whole-pipeline", "accel-h per-stage", "saving",
                           "whole: threshold, min, peak", "per-stage: threshold, min, peak "
                           "(tok/dit/vae/talker/codec)"], lines)


def _hours(arm: Mapping[str, Any] | None) -> str:
    return "SLO not held" if arm is None else f"{arm['accelerator_hours']:.2f}"


def _setting(arm: Mapping[str, Any] | None) -> str:
    if arm is None:
        return "-"
    mins = "/".join(str(arm["min_replicas"][s]) for s in STAGES)
    peaks = "/".join(str(arm["peak_replicas"][s]) for s in STAGES)
    return f"{arm['threshold']}, {mins}, {peaks}"


def chart(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    labels = [f"lag {row['start_lag_s']:.0f} s, SLO {row['slo_factor']:g}x" for row in rows]
    arms = ("whole-pipeline", "per-stage")
    hours = {arm: [(row["arms"][arm] or {}).get("accelerator_hours", 0.0) for row in rows]
             for arm in arms}
    savings = [f"-{row['saving_pct']:.0f}%" if "saving_pct" in row else "" for row in rows]
    first = rows[0]["arms"]
    replica_hours = {arm: [(first[arm] or {}).get("replica_hours", {}).get(s, 0.0)
                           for s in STAGES] for arm in arms}
    return write_bar_chart(path, [
        BarGroup("accelerator-hours at the same p99 SLO", "accelerator-hours", labels, hours,
                 savings),
        BarGroup(f"replica-hours by stage ({labels[0]})", "replica-hours", list(STAGES),
                 replica_hours),
    ], suptitle="stagemesh bench scale: whole-pipeline replicas vs per-stage autoscaling")


ASSUMPTIONS = [
    "a replica computes one request at a time, at the cost measured one at a time "
    "(no batching in either arm)",
    "FIFO queue per stage; any replica of a stage takes any request (in both arms)",
    "speech: the codec starts when the talker is done (no streaming overlap)",
    "measured costs scaled by one factor: a DiT step, averaged over the sizes, takes "
    "dit_step_s (ratios between stages and sizes as measured)",
    "autoscaler every poll_s: ceil((waiting + running) / threshold) replicas within "
    "[min, max], at most doubling per poll, down on the highest wish of the last "
    "scale_down_window_s; threshold 'static': no autoscaling (min replicas, always)",
    "a new replica serves start_lag_s after it is asked for, and costs from that moment",
    "whole-pipeline: one replica count for every stage, set by the stage that wants most",
    "accelerator-hours: replica-hours of tokenizer, dit, vae, talker (k8s gpu overlay)",
    "cancelled requests (30 %) stop at a random step or frame, have no latency, cost their "
    "work up to there",
    "SLO: p99 latency per task <= slo_factor x its p99 with no queueing at all",
    "search: per threshold, bisection on the whole-pipeline minimum; per stage, raise the "
    "minimum of the stage with the worst p99 queue wait until the SLO holds (greedy)",
]


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(prog="stagemesh bench scale",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=float, default=4.0,
                        help="busy DiT (talker) replicas in the image (speech) phase")
    parser.add_argument("--dit-step-s", type=float, default=0.1,
                        help="scale costs so a DiT step, averaged over sizes, takes this")
    parser.add_argument("--slo-factors", default="3,8",
                        help="p99 SLOs per task, as multiples of its p99 with no queueing")
    parser.add_argument("--lags", default="30,60", help="pod start lags to compare, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="measured requests per point")
    parser.add_argument("--costs", type=Path, default=None,
                        help="reuse the measured costs of a previous scale.json (no serve)")
    parser.add_argument("--quick", action="store_true",
                        help="one lag and SLO, one measured request per point")
    parser.add_argument("--out", default="bench-results/scale", help="folder for JSON + PNG")
    args = parser.parse_args(list(argv))
    lags, slo_factors, repeats = _floats(args.lags), _floats(args.slo_factors), args.repeats
    if args.quick:
        lags, slo_factors, repeats = lags[:1], slo_factors[:1], 1
    return Options(out=Path(args.out), load=args.load, dit_step_s=args.dit_step_s,
                   slo_factors=slo_factors, lags=lags, seed=args.seed,
                   measure=MeasureSpec(repeats=repeats), costs=args.costs)


def measured_costs(options: Options) -> tuple[StageCosts, str]:
    """The stage costs (measured now on a served mesh, or read back) and where from."""
    if options.costs is not None:
        raw = json.loads(options.costs.read_text())["measured_costs_s"]
        return StageCosts(
            tokenizer_s=raw["tokenizer_s"],
            dit_step_s={int(k): v for k, v in raw["dit_step_s"].items()},
            vae_s={int(k): v for k, v in raw["vae_s"].items()},
            talker_frame_s=raw["talker_frame_s"], codec_chunk_s=raw["codec_chunk_s"],
            chunk_frames=raw["chunk_frames"]), f"read from {options.costs}"
    with tempfile.TemporaryDirectory() as tmp, \
            serve_mesh(_measured_recipes(Path(tmp)), options.out / "serve.log") as mesh:
        return (asyncio.run(measure_costs(mesh.base_url, options.measure)),
                "measured in this run")


def main(argv: Sequence[str] | None = None) -> None:
    options = parse(argv or [])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    interrupt_on_sigterm()
    watch = Stopwatch()
    measured, source = measured_costs(options)
    measure_s = watch.elapsed()
    factor = options.dit_step_s / measured.mean_dit_step_s
    costs = measured.scaled(factor)
    spec = TraceSpec(load=options.load, steps=options.measure.steps, seed=options.seed)
    trace = make_trace(spec, costs)
    log.info("trace: %d requests over %.0f s; simulating", len(trace),
             sum(p.seconds for p in spec.phases))
    rows = [compare(costs, trace, slo, lag) for slo in options.slo_factors
            for lag in options.lags]
    result = {
        "benchmark": "scale", "created": datetime.now(UTC).isoformat(),
        "machine": machine_info(), "costs_source": source, "measure_seconds": measure_s,
        "simulate_seconds": watch.elapsed() - measure_s,
        "measured_costs_s": dataclasses.asdict(measured), "cost_scale": factor,
        "simulated_costs_s": dataclasses.asdict(costs),
        "trace": {"requests": len(trace), "load": spec.load, "steps": spec.steps,
                  "frames": spec.frames, "cancelled": spec.cancelled, "seed": spec.seed,
                  "phases": [dataclasses.asdict(p) for p in spec.phases]},
        "policy": {k: v for k, v in dataclasses.asdict(Policy(True, 1.0, {})).items()
                   if k not in ("per_stage", "threshold", "min_replicas", "start_lag_s")},
        "thresholds_searched": [_threshold(t) for t in THRESHOLDS],
        "assumptions": ASSUMPTIONS, "rows": rows, "table": table(rows),
    }
    json_path = write_json(options.out / "scale.json", result)
    png_path = chart(options.out / "scale.png", rows)
    log.info("results:\n%s", result["table"])
    log.info("wrote %s and %s", json_path, png_path)
