"""`stagemesh bench gpu`: a real-size Qwen-Image DiT on one CUDA device, in bfloat16.

Prepared for a machine with a GPU; nothing is downloaded. It builds Qwen-Image's transformer at
its real size (Qwen/Qwen-Image transformer/config.json: 60 blocks, 24 heads x 128, text width
3584; 20.4 B parameters, 41 GB in bfloat16) with seeded random weights, straight on the device,
and measures it through the DiT stage's own adapter and engine (no gRPC), at each `--sizes`:

- step time: one request's denoise step (true CFG: a conditional and an unconditional row);
- batching ceiling: 1, 2, 4, 8 ... requests advanced by one step call; images per second, until
  throughput stops growing (< 5% more) or memory runs out;
- abort latency: cancel -> state freed, for cancels at a random point of a step, with the
  mid-step interrupt (the engine's default) and at step boundaries only;
- post-abort overhead: the seed's experiment. Request A is abandoned after a third of its
  steps and request B is sent at once; B's latency is compared with B alone, with A running on
  (no abort), in request mode (a running request cannot be stopped) and in step mode, one
  request at a time, as the seed ran it (its 1024x1024 numbers: +447% without step abort, +3%
  with it).
- parallel arms: the same DiT as a group of ranks, one GPU each (`services/dit/parallel.py`:
  `parallel_cfg: 2`, `parallel_ulysses: 2` and `4`, both), each on a fresh copy of the model
  (its workers build the same seeded weights on their own GPUs), step time of one guided
  request at each `--parallel-sizes` against the one-device arm (the first). The default
  sizes are 1024x1024 and 2880x2880, whose 32,400 image tokens stand in for a video's (Wan
  2.1 at 832x480x81 frames: 32,760). An arm needing more GPUs than the machine has, heads or
  tokens its Ulysses degree does not divide, or time past the budget is skipped (recorded).

Random weights draw noise, but a step costs the same whatever the weights. `--dry-run` runs
every measurement on the CPU, with a 1-block, narrow model at 64x64 for 3 steps, in seconds,
and builds the real-size model on the meta device (no memory) to check its configuration:
everything but the device. `--layers` shrinks the real model (fewer blocks, same width).
`--max-seconds` skips what would start after that much time (each skip is recorded).
Writes gpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import statistics
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from prometheus_client import CollectorRegistry

from stagemesh.bench.common import (
    machine_info,
    markdown_table,
    overhead_pct,
    summarize,
    write_json,
)
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG
from stagemesh.services.dit.parallel import (
    Degrees,
    Family,
    GroupDevices,
    ParallelOptions,
    QwenImageFamily,
    running_group,
)
from stagemesh.services.dit.preview import Preview
from stagemesh.services.dit.qwen_image_adapter import (
    MAX_STEPS,
    MAX_TRUE_CFG_SCALE,
    DenoiseAdapter,
    DenoiseInput,
    DenoiseState,
    DitLimits,
    scheduler_min_steps,
)
from stagemesh.services.dit.types import DenoisedLatents
from stagemesh.shared.devices import DTYPES, Placement, resolve_device, synchronize
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    ExecutionMode,
    NoStream,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.engine import RequestStream, StepEngine
from stagemesh.shared.engine.events import Aborted, Completed, Failed, Progress
from stagemesh.shared.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)

#: Qwen-Image's image latents: 8x spatial VAE, then 2x2 packing.
LATENT_FACTOR = 16
#: Prompt tokens after the template's system prefix is dropped: a sentence-long prompt.
PROMPT_TOKENS = 64
TRUE_CFG_SCALE = 4.0
#: Batch sizes stop growing once one more doubling adds less than this to images per second.
CEILING_GAIN = 1.05
#: The parallel arms (`--parallel`): name -> the group's degrees.
PARALLEL_ARMS = {"one-device": Degrees(), "cfg2": Degrees(cfg=2), "ulysses2": Degrees(ulysses=2),
                 "ulysses4": Degrees(ulysses=4), "cfg2-ulysses2": Degrees(cfg=2, ulysses=2)}
#: The dry run's arms: 2 CPU ranks at most, degrees dividing DRY_RUN's 2 heads.
DRY_RUN_ARMS = ("one-device", "cfg2", "ulysses2")
#: What a parallel arm's workers build their model with (`services/dit/parallel_worker.py`).
GROUP_BUILDER = "stagemesh.bench.gpu:group_family"


@dataclass(frozen=True)
class DitConfig:
    """QwenImageTransformer2DModel's constructor arguments (Qwen/Qwen-Image's by default)."""

    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)  # sums to attention_head_dim
    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16

    def build(self) -> QwenImageTransformer2DModel:
        model: QwenImageTransformer2DModel = QwenImageTransformer2DModel(
            patch_size=self.patch_size, in_channels=self.in_channels,
            out_channels=self.out_channels, num_layers=self.num_layers,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            joint_attention_dim=self.joint_attention_dim, guidance_embeds=False,
            axes_dims_rope=self.axes_dims_rope)
        return model


QWEN_IMAGE = DitConfig()
#: The dry run's model: one block, two narrow heads; every code path of the real one.
DRY_RUN = DitConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2,
                    joint_attention_dim=64, axes_dims_rope=(8, 12, 12))


@dataclass(frozen=True)
class Settings:
    placement: Placement
    config: DitConfig
    sizes: tuple[int, ...]
    steps: int  # per request in the post-abort experiment
    batches: tuple[int, ...]
    abort_samples: int
    seed: int
    max_seconds: float
    parallel: tuple[str, ...] = ()  # PARALLEL_ARMS names
    parallel_sizes: tuple[int, ...] = ()


# -- the model ----------------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_transformer(config: DitConfig, placement: Placement,
                      seed: int) -> QwenImageTransformer2DModel:
    """Seeded random weights, created on the device in the dtype (no float32 copy on the way)."""
    torch.manual_seed(seed)
    with torch.device(placement.device), default_dtype(placement.dtype):
        model = config.build()
    return model.eval().requires_grad_(False)


def parameter_count(config: DitConfig) -> int:
    """The model's parameters, built on the meta device: checks the config, allocates nothing."""
    with torch.device("meta"):
        model = config.build()
    return sum(parameter.numel() for parameter in model.parameters())


def build_adapter(settings: Settings) -> DenoiseAdapter:
    transformer = build_transformer(settings.config, settings.placement, settings.seed)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    side = max(settings.sizes)
    limits = DitLimits(size_multiple=LATENT_FACTOR, max_side=side, max_pixels=side * side,
                       max_steps=MAX_STEPS, max_true_cfg_scale=MAX_TRUE_CFG_SCALE,
                       max_images_per_request=max(settings.batches),
                       min_steps=scheduler_min_steps(scheduler))
    return DenoiseAdapter.from_components(transformer, scheduler, limits)


def embeddings(config: DitConfig, placement: Placement, seed: int) -> PromptEmbeddings:
    """A prompt and a negative prompt's embeddings (seeded), as the wire brings them."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, PROMPT_TOKENS, config.joint_attention_dim)
    prompt, negative = (torch.randn(shape, generator=generator).to(placement.dtype)
                        for _ in range(2))
    return PromptEmbeddings(prompt, None, negative, None)


def denoise_input(settings: Settings, size: int, steps: int, seed: int = 0) -> DenoiseInput:
    return DenoiseInput(embeddings(settings.config, settings.placement, settings.seed), size,
                        size, steps, true_cfg_scale=TRUE_CFG_SCALE, seed=seed)


# -- result records (gpu.json is these, as JSON) ------------------------------------------------

Summary = dict[str, float | int]  # bench.common.summarize: n, mean, p50, p99, min, max, cv_pct


@dataclass(frozen=True)
class StepTime:
    size: int
    step_seconds: Summary


@dataclass(frozen=True)
class BatchRow:
    batch: int
    step_seconds: float | None  # None: out of memory
    images_per_second: float | None


@dataclass(frozen=True)
class Batching:
    size: int
    rows: list[BatchRow]
    ceiling_batch: int  # the batch size with the most images per second
    ceiling_images_per_second: float


@dataclass(frozen=True)
class AbortLatency:
    size: int
    step_boundary: Summary  # seconds from cancel to state freed
    mid_step: Summary


@dataclass(frozen=True)
class PostAbortRow:
    configuration: str
    b_seconds: float
    overhead_pct: float  # against the baseline row
    a_outcome: str  # "none" (baseline), "completed" or "aborted"
    a_steps: int  # steps A completed in all


@dataclass(frozen=True)
class PostAbort:
    size: int
    steps: int
    abandoned_after_s: float
    rows: list[PostAbortRow]


@dataclass(frozen=True)
class ParallelRow:
    arm: str
    ranks: int
    size: int
    step_seconds: float  # p50 of 5 steps after a warm-up
    speedup: float | None  # the one-device arm's step over this one's (None: not measured)


@dataclass
class Report:
    build_seconds: float
    parameters: int
    step_time: list[StepTime] = dataclasses.field(default_factory=list)
    batching: list[Batching] = dataclasses.field(default_factory=list)
    abort_latency: list[AbortLatency] = dataclasses.field(default_factory=list)
    post_abort: list[PostAbort] = dataclasses.field(default_factory=list)
    parallel: list[ParallelRow] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # sections past the budget
    max_memory_allocated_bytes: int | None = None


# -- step time and batching (the adapter alone) -----------------------------------------------


def timed_steps(adapter: DenoiseAdapter, states: Sequence[DenoiseState], steps: int,
                device: torch.device) -> list[float]:
    """Seconds of each of `steps` step calls over `states`, the device's work included."""
    seconds = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        adapter.step(states)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def prepared(adapter: DenoiseAdapter, payload: DenoiseInput, count: int) -> list[DenoiseState]:
    """`count` requests like `payload` (seeds 0, 1, ...), prepared."""
    return [adapter.prepare(EngineRequest(request_id=f"r{seed}",
                                          payload=dataclasses.replace(payload, seed=seed)))
            for seed in range(count)]


def measure_step_time(adapter: DenoiseAdapter, settings: Settings, size: int) -> StepTime:
    """One request with true CFG: a warm-up step, then 5 timed steps."""
    (state,) = prepared(adapter, denoise_input(settings, size, steps=6), 1)
    device = settings.placement.device
    timed_steps(adapter, [state], 1, device)
    seconds = timed_steps(adapter, [state], 5, device)
    adapter.release(state)
    return StepTime(size, summarize(seconds))


def batch_step_seconds(adapter: DenoiseAdapter, settings: Settings, size: int,
                       batch: int) -> float | None:
    """Median seconds of a step over `batch` requests (after a warm-up); None if out of memory."""
    states = prepared(adapter, denoise_input(settings, size, steps=4), batch)
    device = settings.placement.device
    try:
        timed_steps(adapter, states, 1, device)
        return statistics.median(timed_steps(adapter, states, 2, device))
    except torch.OutOfMemoryError:
        return None
    finally:
        for state in states:
            adapter.release(state)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_batching(adapter: DenoiseAdapter, settings: Settings, size: int) -> Batching:
    """Images per second at each batch size, until throughput stops growing or memory ends."""
    rows: list[BatchRow] = []
    for batch in settings.batches:
        step_s = batch_step_seconds(adapter, settings, size, batch)
        rows.append(BatchRow(batch, step_s, None if step_s is None else batch / step_s))
        if len(rows) > 1 and not _grew(rows[-2], rows[-1]):
            break
    best = max((r for r in rows if r.images_per_second is not None),
               key=lambda r: r.images_per_second or 0.0)
    return Batching(size, rows, best.batch, best.images_per_second or 0.0)


def _grew(before: BatchRow, after: BatchRow) -> bool:
    if before.images_per_second is None or after.images_per_second is None:
        return False
    return after.images_per_second >= before.images_per_second * CEILING_GAIN


# -- abort latency and post-abort overhead (the engine) -----------------------------------------


class StepBoundaryOnly:
    """The adapter without its mid-step interrupt: the engine then stops a request only at a
    step boundary (as for an adapter without `bind_interrupt`)."""

    def __init__(self, adapter: DenoiseAdapter) -> None:
        self._adapter = adapter
        self.stage = adapter.stage

    def check_inputs(self, payload: DenoiseInput) -> None:
        self._adapter.check_inputs(payload)

    def prepare(self, request: EngineRequest[DenoiseInput]) -> DenoiseState:
        return self._adapter.prepare(request)

    def add_input(self, state: DenoiseState, payload: NoStream) -> None:
        self._adapter.add_input(state, payload)

    def step(self, states: Sequence[DenoiseState]) -> Sequence[StepOutput[Preview]]:
        return self._adapter.step(states)

    def finish(self, state: DenoiseState) -> DenoisedLatents:
        return self._adapter.finish(state)

    def release(self, state: DenoiseState) -> None:
        self._adapter.release(state)

    def batch_key(self, state: DenoiseState) -> Hashable:
        return self._adapter.batch_key(state)


DitEngine = StepEngine[DenoiseInput, NoStream, DenoiseState, Preview, DenoisedLatents]
DitStream = RequestStream[Preview, DenoisedLatents]
Terminal = Completed[DenoisedLatents] | Aborted | Failed


@contextlib.contextmanager
def running_engine(adapter: DenoiseAdapter | StepBoundaryOnly,
                   mode: ExecutionMode = ExecutionMode.STEP) -> Iterator[DitEngine]:
    """A started engine that runs one request at a time (the seed's serial DiT)."""
    engine: DitEngine = StepEngine(adapter, mode=mode, max_running=1,
                                   metrics=EngineMetrics("dit", registry=CollectorRegistry()))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown(abort_running=True, timeout=120)


def submit(engine: DitEngine, payload: DenoiseInput, request_id: str) -> DitStream:
    return engine.submit(EngineRequest(
        request_id=request_id, payload=payload,
        budget=StepBudget(total_steps=payload.num_inference_steps)))


async def first_progress(stream: DitStream) -> None:
    async for event in stream:
        if isinstance(event, Progress):
            return
        if isinstance(event, Completed | Aborted | Failed):
            raise RuntimeError(f"{stream.request_id} ended before its first step: {event}")


async def terminal(stream: DitStream) -> Terminal:
    async for event in stream:
        if isinstance(event, Completed | Aborted | Failed):
            return event
    raise RuntimeError(f"{stream.request_id} ended without a terminal event")


async def abort_latencies(engine: DitEngine, payload: DenoiseInput, samples: int,
                          step_s: float, rng: random.Random) -> list[float]:
    """Cancel each sample at a random point of a step once it runs; the engine's latencies."""
    latencies = []
    for sample in range(samples):
        request_id = f"abort-{sample}"
        stream = submit(engine, payload, request_id)
        await first_progress(stream)
        await asyncio.sleep(rng.uniform(0.0, step_s))
        engine.abort(request_id)
        outcome = await terminal(stream)
        if not isinstance(outcome, Aborted):
            raise RuntimeError(f"{request_id} was cancelled but ended with {outcome}")
        latencies.append(outcome.abort_latency_seconds)
    return latencies


async def measure_abort(adapter: DenoiseAdapter, settings: Settings, size: int,
                        step_s: float) -> AbortLatency:
    payload = denoise_input(settings, size, steps=50)  # never finishes before its cancel
    rng = random.Random(settings.seed)
    summaries = []
    for engine_adapter in (StepBoundaryOnly(adapter), adapter):
        with running_engine(engine_adapter) as engine:
            seconds = await abort_latencies(engine, payload, settings.abort_samples, step_s, rng)
        summaries.append(summarize(seconds))
    return AbortLatency(size, *summaries)


async def post_abort_run(engine: DitEngine, payload: DenoiseInput,
                         abandon_after_s: float | None, abort_a: bool) -> tuple[float, str, int]:
    """B's latency, A's outcome and A's steps. A (if any) starts first; after
    `abandon_after_s` its client leaves (cancelling it if `abort_a`) and B is sent."""
    a_stream = None
    if abandon_after_s is not None:
        a_stream = submit(engine, dataclasses.replace(payload, seed=1), "A")
        await asyncio.sleep(abandon_after_s)
        if abort_a:
            engine.abort("A")
    started = time.perf_counter()
    b_outcome = await terminal(submit(engine, payload, "B"))
    b_seconds = time.perf_counter() - started
    if not isinstance(b_outcome, Completed):
        raise RuntimeError(f"request B did not complete: {b_outcome}")
    if a_stream is None:
        return b_seconds, "none", 0
    a_end = await terminal(a_stream)
    if isinstance(a_end, Failed):
        raise RuntimeError(f"request A failed: {a_end.message}")
    return b_seconds, "aborted" if isinstance(a_end, Aborted) else "completed", a_end.step_index


async def measure_post_abort(adapter: DenoiseAdapter, settings: Settings, size: int,
                             step_s: float) -> PostAbort:
    """The seed's three configurations against B alone, in the same run."""
    payload = denoise_input(settings, size, settings.steps)
    abandon_after_s = settings.steps / 3 * step_s
    configurations = (
        ("baseline (B alone)", ExecutionMode.STEP, None, False),
        ("no abort (A runs on)", ExecutionMode.STEP, abandon_after_s, False),
        ("abort waiting only (request mode)", ExecutionMode.REQUEST, abandon_after_s, True),
        ("abort waiting + running (step mode)", ExecutionMode.STEP, abandon_after_s, True),
    )
    rows: list[PostAbortRow] = []
    for name, mode, abandon, abort_a in configurations:
        with running_engine(adapter, mode) as engine:
            b_seconds, a_outcome, a_steps = await post_abort_run(engine, payload, abandon,
                                                                 abort_a)
        baseline = rows[0].b_seconds if rows else b_seconds
        rows.append(PostAbortRow(name, b_seconds, overhead_pct(b_seconds, baseline), a_outcome,
                                 a_steps))
    return PostAbort(size, settings.steps, abandon_after_s, rows)


# -- the run ------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget: a section that would start after `max_seconds` is skipped and
    recorded as skipped."""

    def __init__(self, max_seconds: float, skipped: list[str]) -> None:
        self.deadline = time.monotonic() + max_seconds
        self.skipped = skipped

    def allows(self, section: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        log.warning("time budget spent: skipping %s", section)
        self.skipped.append(section)
        return False


async def measure(settings: Settings) -> Report:
    """Every measurement, at every size, in order, as far as the time budget goes."""
    device = settings.placement.device
    started = time.perf_counter()
    adapter = build_adapter(settings)
    synchronize(device)
    report = Report(build_seconds=time.perf_counter() - started,
                    parameters=sum(p.numel() for p in adapter.transformer.parameters()))
    budget = Budget(settings.max_seconds, report.skipped)
    log.info("built a %d-parameter DiT on %s in %.1f s", report.parameters, device,
             report.build_seconds)
    for size in settings.sizes:
        if budget.allows(f"step time {size}"):
            report.step_time.append(measure_step_time(adapter, settings, size))
    for size in settings.sizes:
        if budget.allows(f"batching {size}"):
            report.batching.append(measure_batching(adapter, settings, size))
    for step_time in report.step_time:
        step_s = float(step_time.step_seconds["p50"])
        if budget.allows(f"abort latency {step_time.size}"):
            report.abort_latency.append(await measure_abort(adapter, settings, step_time.size,
                                                            step_s))
        if budget.allows(f"post-abort {step_time.size}"):
            report.post_abort.append(await measure_post_abort(adapter, settings,
                                                              step_time.size, step_s))
    if device.type == "cuda":
        report.max_memory_allocated_bytes = torch.cuda.max_memory_allocated(device)
    del adapter  # each parallel arm builds its own copy: two would not fit beside each other
    report.parallel = measure_parallel(settings, budget)
    return report


# -- parallel arms (a DiT group of ranks, one device each) -------------------------------------


def group_family(source: str, options: Mapping[str, object]) -> tuple[Family, Degrees]:
    """A parallel arm's worker model (GROUP_BUILDER): rank 0's seeded transformer, `source`
    being its configuration, dtype and seed as JSON, on the worker's device."""
    spec = json.loads(source)
    config = DitConfig(**{**spec["config"], "axes_dims_rope": tuple(spec["config"]
                                                                    ["axes_dims_rope"])})
    placement = Placement(torch.device(str(options["device"])), DTYPES[spec["dtype"]])
    degrees = Degrees.from_options(cast(ParallelOptions, options))
    return QwenImageFamily(build_transformer(config, placement, spec["seed"])), degrees


def arm_refusal(settings: Settings, degrees: Degrees, size: int | None = None) -> str | None:
    """Why an arm cannot run here (at `size`), or None."""
    try:
        degrees.check_heads(settings.config.num_attention_heads)
        GroupDevices.named(settings.placement.device).check(degrees)
    except ValueError as error:
        return str(error)
    if size is not None and (size // LATENT_FACTOR) ** 2 % degrees.ulysses:
        return f"{(size // LATENT_FACTOR) ** 2} tokens do not divide among {degrees.ulysses}"
    return None


def measure_parallel(settings: Settings, budget: Budget) -> list[ParallelRow]:
    """Each arm's step time at each size, on a freshly built model (a Ulysses arm's hooks stay
    on the transformer they were applied to), against the one-device arm's (run first)."""
    baseline: dict[int, float] = {}
    source = json.dumps({"config": dataclasses.asdict(settings.config),
                         "dtype": settings.placement.dtype_name, "seed": settings.seed})
    rows = []
    for arm in settings.parallel:
        degrees = PARALLEL_ARMS[arm]
        if refused := arm_refusal(settings, degrees):
            budget.skipped.append(f"parallel {arm}: {refused}")
            continue
        if not budget.allows(f"parallel {arm}"):
            continue
        adapter = build_adapter(settings)
        family = QwenImageFamily(adapter.transformer)
        with (running_group(family, source, degrees, GROUP_BUILDER) if degrees.world > 1
              else contextlib.nullcontext()) as adapter.group:
            for size in settings.parallel_sizes:
                if refused := arm_refusal(settings, degrees, size):
                    budget.skipped.append(f"parallel {arm} {size}: {refused}")
                elif budget.allows(f"parallel {arm} {size}"):
                    p50 = float(measure_step_time(adapter, settings, size).step_seconds["p50"])
                    if degrees.world == 1:
                        baseline[size] = p50
                    rows.append(ParallelRow(arm, degrees.world, size, p50,
                                            baseline[size] / p50 if size in baseline else None))
        del adapter, family
        if settings.placement.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def device_facts(device: torch.device) -> dict[str, object]:
    if device.type != "cuda":
        return {"device": str(device)}
    props = torch.cuda.get_device_properties(device)
    return {"device": str(device), "name": props.name, "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}


def tables(report: Report) -> str:
    """The run as Markdown tables (for the log, and the README)."""
    def ms(seconds: float | int | None) -> str:
        return "OOM" if seconds is None else f"{1000 * seconds:.0f} ms"

    parts = [markdown_table(["size", "step p50", "step p99"], [
        [f"{t.size}x{t.size}", ms(t.step_seconds["p50"]), ms(t.step_seconds["p99"])]
        for t in report.step_time])]
    parts += [markdown_table(["size", "batch", "step", "images/s"], [
        [f"{b.size}x{b.size}", row.batch, ms(row.step_seconds),
         "-" if row.images_per_second is None else f"{row.images_per_second:.2f}"]
        for row in b.rows]) for b in report.batching]
    parts.append(markdown_table(["size", "abort p50 / p99 (step boundary)",
                                 "abort p50 / p99 (mid-step)"], [
        [f"{a.size}x{a.size}", f"{ms(a.step_boundary['p50'])} / {ms(a.step_boundary['p99'])}",
         f"{ms(a.mid_step['p50'])} / {ms(a.mid_step['p99'])}"] for a in report.abort_latency]))
    parts += [markdown_table(["configuration", "size", "B latency", "overhead", "A's steps"], [
        [row.configuration, f"{p.size}x{p.size}", f"{row.b_seconds:.2f} s",
         f"{row.overhead_pct:+.0f}%", row.a_steps] for row in p.rows]) for p in report.post_abort]
    parts.append(markdown_table(["arm", "ranks", "size", "step p50", "speed-up"], [
        [row.arm, row.ranks, f"{row.size}x{row.size}", ms(row.step_seconds),
         "-" if row.speedup is None else f"{row.speedup:.2f}x"] for row in report.parallel]))
    return "\n\n".join(parts)


def settings_from(args: argparse.Namespace) -> Settings:
    """The run's settings; a device this machine lacks is a SystemExit saying so."""
    arms = tuple(arm for arm in args.parallel.split(",") if arm)
    if unknown := sorted(set(arms) - set(PARALLEL_ARMS)):
        raise SystemExit(f"unknown parallel arms {unknown}; known: {list(PARALLEL_ARMS)}")
    if args.dry_run:  # the arms whose degrees divide the tiny model's 2 heads
        return Settings(placement=Placement(torch.device("cpu"), DTYPES[args.dtype]),
                        config=DRY_RUN, sizes=(64,), steps=3, batches=(1, 2), abort_samples=2,
                        seed=args.seed, max_seconds=args.max_seconds,
                        parallel=tuple(a for a in arms if a in DRY_RUN_ARMS),
                        parallel_sizes=(64,))
    try:
        device = resolve_device("bench gpu", args.device)
    except ValueError as error:
        raise SystemExit(f"{error}; `--dry-run` checks everything else on the CPU") from error
    config = dataclasses.replace(QWEN_IMAGE, num_layers=args.layers)
    return Settings(placement=Placement(device, DTYPES[args.dtype]), config=config,
                    sizes=_ints(args.sizes), steps=args.steps, batches=_ints(args.batches),
                    abort_samples=args.abort_samples, seed=args.seed,
                    max_seconds=args.max_seconds, parallel=arms,
                    parallel_sizes=_ints(args.parallel_sizes))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="everything on the CPU with a tiny model, in seconds")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--layers", type=int, default=QWEN_IMAGE.num_layers,
                        help="transformer blocks (Qwen-Image: 60); fewer to fit a smaller GPU")
    parser.add_argument("--sizes", default="512,1024", help="square image sides, in pixels")
    parser.add_argument("--steps", type=int, default=20,
                        help="denoise steps per request in the post-abort experiment")
    parser.add_argument("--batches", default="1,2,4,8,16", help="batch sizes to try, ascending")
    parser.add_argument("--abort-samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=420.0,
                        help="skip sections that would start later than this")
    parser.add_argument("--parallel", default=",".join(PARALLEL_ARMS),
                        help="parallel arms, comma-separated ('' for none)")
    parser.add_argument("--parallel-sizes", default="1024,2880",
                        help="square image sides of the parallel arms")
    parser.add_argument("--out", default="bench-results/gpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = settings_from(args)
    real_size = parameter_count(dataclasses.replace(QWEN_IMAGE, num_layers=args.layers))
    log.info("Qwen-Image DiT at %d blocks: %d parameters (checked on the meta device)",
             args.layers, real_size)
    report = asyncio.run(measure(settings))
    document = {"benchmark": "gpu", "created": datetime.now(UTC).isoformat(),
                "dry_run": args.dry_run, "machine": machine_info(),
                "device": device_facts(settings.placement.device),
                "dtype": settings.placement.dtype_name, "torch": torch.__version__,
                "model": dataclasses.asdict(settings.config),
                "real_size_parameters": real_size, "true_cfg_scale": TRUE_CFG_SCALE,
                "prompt_tokens": PROMPT_TOKENS, **dataclasses.asdict(report)}
    path = write_json(Path(args.out) / "gpu.json", document)
    log.info("results:\n%s", tables(report))
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
