"""`stagemesh bench abort`: what an abandoned request costs the next one.

Reproduces the seed PR's abort table on this machine, every number from one run of one mesh
(`stagemesh serve` with the benchmark-sized Qwen-Image DiT, built on first use):

- baseline: one request alone, in the configuration's execution mode;
- post-abort: request A is started, abandoned after about a third of its denoise steps (seen as
  SSE progress events), and request B is sent at once; B's latency is the post-abort latency.
  Configurations, as in the seed:
    no_abort       request mode; A is abandoned but never cancelled (the client stops caring and
                   keeps the connection open), so A runs to its end, VAE decode included;
    abort_waiting  request mode; the client disconnects, which cancels A in the mesh, but a
                   running request-mode request only stops when its denoise loop ends;
    step_mode      step mode; the client disconnects and A stops at its next step boundary;
- abort latency: step-mode requests cancelled mid-run by `POST /v1/requests/{id}/cancel`; the
  stage answers with the step it stopped at and the time from the cancel to freeing the state.

Around every sample the DiT and VAE stages' Prometheus counters are read, so the report says
how many steps A really ran, whether the VAE decoded it, and the abort latency the DiT measured.
Every sample starts with the mesh idle; the configurations are interleaved per repeat, so a noisy
machine skews them alike. The JSON keeps every sample; the table shows medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import logging
import random
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from stagemesh.bench.common import (
    BarGroup,
    Samples,
    Stopwatch,
    interrupt_on_sigterm,
    machine_info,
    markdown_table,
    metric_value,
    overhead_pct,
    scrape,
    serve_mesh,
    summarize,
    write_bar_chart,
    write_json,
)
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.protocol import parse_size

log = logging.getLogger(__name__)

RECIPE_NAME = "qwen-image-bench"
PROMPT = "a red circle above a blue square, flat colours"
NEGATIVE_PROMPT = " "
#: The per-step time the benchmark's DiT is sized for (issue 3): outside it, a warning.
TARGET_STEP_S = (0.050, 0.150)
#: Longest any single request may take before the benchmark gives up on it.
REQUEST_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 120.0
MAX_STEPS = 200
#: The bench model's latent factor (VAE x8, 2x2 patches): sizes must be multiples of it.
SIZE_MULTIPLE = 16

# The stage addresses are placeholders: `--stage-ports auto` moves every stage to a free port.
RECIPE_TEMPLATE = """\
recipes:
  - name: {name}
    task: text-to-image
    model: builtin:qwen-image-bench
    stages:
      tokenizer: {{address: "127.0.0.1:1", metrics_port: 1}}
      dit: {{address: "127.0.0.1:2", metrics_port: 2,
            options: {{step_execution: true, request_mode: true, max_steps: {max_steps},
                      max_images_per_request: 1, max_pixels: 1048576}}}}
      vae: {{address: "127.0.0.1:3", metrics_port: 3}}
    defaults: {{width: {width}, height: {height}, num_inference_steps: {steps},
               true_cfg_scale: {cfg}, negative_prompt: "{negative}"}}
"""


class Action(enum.StrEnum):
    """What the client does to request A once it has decided to abandon it."""

    ABANDON = "abandon"  # stop caring, keep the connection: nothing in the mesh is cancelled
    DISCONNECT = "disconnect"  # close the connection: the gateway cancels A


@dataclass(frozen=True)
class Configuration:
    key: str
    label: str
    mode: str  # the request's execution_mode: "request" or "step"
    action: Action


CONFIGURATIONS = (
    Configuration("no_abort", "No abort (request mode, seed's original)", "request",
                  Action.ABANDON),
    Configuration("abort_waiting", "Abort waiting only (request mode)", "request",
                  Action.DISCONNECT),
    Configuration("step_mode", "Abort waiting + running (step mode)", "step", Action.DISCONNECT),
)


@dataclass(frozen=True)
class Options:
    steps: int
    width: int
    height: int
    repeats: int
    cancels: int
    abort_fraction: float
    cfg_scale: float
    threads: int
    seed: int
    out: Path

    @property
    def resolution(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def abort_step(self) -> int:
        """The progress step after which A is abandoned."""
        return min(self.steps - 1, max(1, round(self.steps * self.abort_fraction)))


@dataclass
class StreamRun:
    """What the client saw of one streamed image request."""

    request_id: str
    clock: Stopwatch = field(default_factory=Stopwatch)
    steps_seen: int = 0  # the last DiT progress step received
    first_step_s: float | None = None  # from sending to the first DiT progress event
    step_seconds: list[float] = field(default_factory=list)
    latency_s: float | None = None  # from sending to the image (None if there was none)
    error: dict[str, Any] | None = None


@dataclass
class Milestone:
    """Set once a stream has shown `step` DiT progress events (or ended before that)."""

    step: int
    reached: asyncio.Event = field(default_factory=asyncio.Event)


class BenchClient:
    """The benchmark's HTTP client of one mesh."""

    def __init__(self, http: httpx.AsyncClient, options: Options,
                 metrics_urls: dict[str, str]) -> None:
        self.http = http
        self.options = options
        self.metrics_urls = metrics_urls  # stage name -> its /metrics URL

    def body(self, mode: str, steps: int | None = None) -> dict[str, Any]:
        o = self.options
        return {"model": RECIPE_NAME, "prompt": PROMPT, "negative_prompt": NEGATIVE_PROMPT,
                "size": o.resolution, "num_inference_steps": steps or o.steps,
                "true_cfg_scale": o.cfg_scale, "seed": o.seed, "execution_mode": mode,
                "stream": True}

    async def generate(self, run: StreamRun, body: dict[str, Any],
                       milestone: Milestone | None = None) -> StreamRun:
        """Stream one request to its end, recording DiT progress; never raises on an error
        event (it is recorded), so a cancelled request reads as one."""
        try:
            async with self.http.stream("POST", "/v1/images/generations", json=body,
                                        headers={"x-request-id": run.request_id}) as response:
                if response.status_code != 200:
                    await response.aread()
                    run.error = {"status": response.status_code, "body": response.text}
                    return run
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and self._on_event(run, line[6:], milestone):
                        break
        finally:
            if milestone is not None:
                milestone.reached.set()
        return run

    @staticmethod
    def _on_event(run: StreamRun, data: str, milestone: Milestone | None) -> bool:
        """Record one SSE event; True at the end of the stream."""
        if data == "[DONE]":
            return True
        event = json.loads(data)
        kind = event.get("type")
        if kind == "progress" and event.get("stage") == "dit":
            run.steps_seen = int(event["step"])
            run.step_seconds.append(float(event["step_seconds"]))
            if run.first_step_s is None:
                run.first_step_s = run.clock.elapsed()
            if milestone is not None and run.steps_seen >= milestone.step:
                milestone.reached.set()
        elif kind == "image":
            run.latency_s = run.clock.elapsed()
        elif kind == "error":
            run.error = event
        return False

    async def cancel(self, request_id: str) -> dict[str, Any]:
        response = await self.http.post(f"/v1/requests/{request_id}/cancel")
        response.raise_for_status()
        reply: dict[str, Any] = response.json()
        return reply

    async def wait_idle(self) -> dict[str, Samples]:
        """Every stage's metrics once none has anything waiting or running (a clean start)."""
        clock = Stopwatch()
        while True:
            samples = {stage: await scrape(self.http, url)
                       for stage, url in self.metrics_urls.items()}
            busy = sum(metric_value(s, "stagemesh_requests_waiting")
                       + metric_value(s, "stagemesh_requests_running") for s in samples.values())
            if not busy:
                return samples
            if clock.elapsed() > IDLE_TIMEOUT_S:
                raise TimeoutError(f"the mesh still busy after {IDLE_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)


def _wait_for_dit(run: StreamRun) -> float | None:
    """How long a request waited before the DiT started it: to its first progress event,
    less that first step's own duration (the tokenizer's few ms included)."""
    if run.first_step_s is None or not run.step_seconds:
        return None
    return run.first_step_s - run.step_seconds[0]


def _require_image(run: StreamRun, what: str) -> float:
    if run.latency_s is None:
        raise RuntimeError(f"{what} ({run.request_id}) returned no image: {run.error}")
    return run.latency_s


@dataclass(frozen=True)
class StageDelta:
    """What one stage did between two scrapes."""

    steps: int
    completed: int
    aborted: int
    abort_latency_s: float  # sum over the aborts in between

    @classmethod
    def between(cls, before: Samples, after: Samples) -> StageDelta:
        def delta(name: str, **labels: str) -> float:
            return metric_value(after, name, **labels) - metric_value(before, name, **labels)

        return cls(
            steps=round(delta("stagemesh_steps_total")),
            completed=round(delta("stagemesh_requests_finished_total", status="completed")),
            aborted=round(delta("stagemesh_requests_finished_total", status="aborted")),
            abort_latency_s=delta("stagemesh_abort_latency_seconds_sum"))


class AbortBenchmark:
    """The measurements; each leaves the DiT idle for the next."""

    def __init__(self, client: BenchClient, options: Options) -> None:
        self.client = client
        self.options = options
        self.rng = random.Random(options.seed)
        self.run_id = uuid.uuid4().hex[:8]
        self._count = 0

    def _new_run(self, tag: str) -> StreamRun:
        self._count += 1
        return StreamRun(f"bench-{self.run_id}-{self._count:03d}-{tag}")

    async def warm_up(self) -> None:
        """One short request per mode: first-call costs (allocations, lazy init) go here."""
        for mode in ("request", "step"):
            body = self.client.body(mode, steps=min(3, self.options.steps))
            run = await self.client.generate(self._new_run(f"warmup-{mode}"), body)
            _require_image(run, "warm-up request")

    async def baseline(self, config: Configuration) -> dict[str, Any]:
        await self.client.wait_idle()
        run = await self.client.generate(self._new_run(f"{config.key}-base"),
                                         self.client.body(config.mode))
        return {"latency_s": _require_image(run, "baseline request"),
                "first_step_s": run.first_step_s, "step_seconds": run.step_seconds}

    async def _start_until(self, run: StreamRun, body: dict[str, Any],
                           step: int) -> asyncio.Task[StreamRun]:
        """Start a request and return once it has shown `step` progress events, plus a random
        fraction of a step (so the abort lands anywhere within a step, not just after one)."""
        milestone = Milestone(step)
        task = asyncio.create_task(self.client.generate(run, body, milestone))
        await asyncio.wait_for(milestone.reached.wait(), REQUEST_TIMEOUT_S)
        if run.steps_seen < step:
            await task
            raise RuntimeError(f"request {run.request_id} ended after {run.steps_seen} steps, "
                               f"before step {step}: {run.error}")
        await asyncio.sleep(self.rng.uniform(0.0, run.step_seconds[-1]))
        return task

    async def post_abort(self, config: Configuration) -> dict[str, Any]:
        before = await self.client.wait_idle()
        a = self._new_run(f"{config.key}-A")
        task = await self._start_until(a, self.client.body(config.mode), self.options.abort_step)
        seen = a.steps_seen
        if config.action is Action.DISCONNECT:
            await _cancel_task(task)
        b = await self.client.generate(self._new_run(f"{config.key}-B"),
                                       self.client.body(config.mode))
        if config.action is Action.ABANDON:
            _require_image(await task, "abandoned request A")
        after = await self.client.wait_idle()
        dit = StageDelta.between(before["dit"], after["dit"])
        vae = StageDelta.between(before["vae"], after["vae"])
        a_steps = dit.steps - self.options.steps  # B ran all of its steps
        return {"latency_s": _require_image(b, "post-abort request B"),
                "b_wait_s": _wait_for_dit(b), "a_steps_seen": seen, "a_steps_run": a_steps,
                "a_steps_after_abort": a_steps - seen, "a_aborted_in_dit": dit.aborted == 1,
                "a_decoded_by_vae": vae.completed > 1,
                "abort_latency_s": dit.abort_latency_s if dit.aborted == 1 else None}

    async def explicit_cancel(self) -> dict[str, Any]:
        """Cancel a running step-mode request by id; the stage says where it stopped."""
        before = await self.client.wait_idle()
        a = self._new_run("cancel")
        task = await self._start_until(a, self.client.body("step"), self.options.abort_step)
        seen = a.steps_seen
        clock = Stopwatch()
        reply = await self.client.cancel(a.request_id)
        round_trip = clock.elapsed()
        await asyncio.wait_for(task, REQUEST_TIMEOUT_S)
        if a.latency_s is not None:
            raise RuntimeError(f"cancelled request {a.request_id} still returned an image")
        dit = StageDelta.between(before["dit"], (await self.client.wait_idle())["dit"])
        step_index = int(reply.get("step_index", 0))
        return {"stage": reply.get("stage", ""), "steps_seen": seen, "step_index": step_index,
                "steps_after_cancel": step_index - seen, "steps_computed": dit.steps,
                "steps_computed_after_cancel": dit.steps - seen,
                "abort_latency_s": float(reply.get("abort_latency_seconds", 0.0)),
                "round_trip_s": round_trip}

    async def run(self) -> dict[str, Any]:
        """Every measurement, interleaved per repeat so machine noise hits all alike."""
        await self.warm_up()
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {
            c.key: {"baseline": [], "post_abort": []} for c in CONFIGURATIONS}
        cancels: list[dict[str, Any]] = []
        per_repeat = -(-self.options.cancels // self.options.repeats)
        for repeat in range(self.options.repeats):
            for config in CONFIGURATIONS:
                samples[config.key]["baseline"].append(await self.baseline(config))
                samples[config.key]["post_abort"].append(await self.post_abort(config))
                log.info("repeat %d/%d %s: baseline %.2f s, post-abort %.2f s", repeat + 1,
                         self.options.repeats, config.key,
                         samples[config.key]["baseline"][-1]["latency_s"],
                         samples[config.key]["post_abort"][-1]["latency_s"])
            while len(cancels) < min(self.options.cancels, (repeat + 1) * per_repeat):
                cancels.append(await self.explicit_cancel())
        return {"samples": samples, "explicit_cancels": cancels}


async def _cancel_task(task: asyncio.Task[Any]) -> None:
    """Cancel the client task of a request: httpx closes its connection (a disconnect)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# -- report -------------------------------------------------------------------------------------


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key) is not None]


def build_report(options: Options, measured: dict[str, Any], machine_start: dict[str, Any],
                 machine_end: dict[str, Any]) -> dict[str, Any]:
    configurations = []
    for config in CONFIGURATIONS:
        rows = measured["samples"][config.key]
        baseline = summarize(_values(rows["baseline"], "latency_s"))
        post = summarize(_values(rows["post_abort"], "latency_s"))
        configurations.append({
            **asdict(config), "resolution": options.resolution,
            "baseline_s": baseline, "post_abort_s": post,
            "overhead_pct": overhead_pct(post["p50"], baseline["p50"]),
            "b_wait_s": summarize(_values(rows["post_abort"], "b_wait_s")),
            "a_steps_after_abort": summarize(_values(rows["post_abort"], "a_steps_after_abort")),
            "a_decoded_by_vae": sum(bool(r["a_decoded_by_vae"]) for r in rows["post_abort"]),
            "abort_latency_s": summarize(_values(rows["post_abort"], "abort_latency_s")),
            "samples": rows,
        })
    cancels = measured["explicit_cancels"]
    step_times = [s for c in measured["samples"].values() for row in c["baseline"]
                  for s in row["step_seconds"]]
    return {
        "benchmark": "abort",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "options": {**asdict(options), "out": str(options.out),
                    "abort_step": options.abort_step},
        "machine": {"start": machine_start, "end": machine_end},
        "dit_step_s": summarize(step_times),
        "configurations": configurations,
        "explicit_cancel": {
            "abort_latency_s": summarize(_values(cancels, "abort_latency_s")),
            "steps_after_cancel": summarize(_values(cancels, "steps_after_cancel")),
            "steps_computed_after_cancel": summarize(
                _values(cancels, "steps_computed_after_cancel")),
            "round_trip_s": summarize(_values(cancels, "round_trip_s")),
            "samples": cancels,
        },
    }


def _latency_note(configuration: dict[str, Any]) -> str:
    """Why a configuration has no abort latency ("" when it has one)."""
    if configuration["action"] == Action.ABANDON:
        return "never cancelled"
    if not configuration["abort_latency_s"].get("n"):
        return "not honoured while running"
    return ""


def _latency_cell(configuration: dict[str, Any]) -> str:
    stats = configuration["abort_latency_s"]
    note = _latency_note(configuration)
    return note or f"{stats['p50'] * 1e3:.0f} / {stats['p99'] * 1e3:.0f} ms"


def table(report: dict[str, Any]) -> str:
    """The seed PR's table: medians over the repeats."""
    rows = []
    for c in report["configurations"]:
        base, post = c["baseline_s"]["p50"], c["post_abort_s"]["p50"]
        rows.append([c["label"], c["resolution"], f"{base:.2f}s", f"{post:.2f}s",
                     f"{post - base:+.2f}s ({c['overhead_pct']:+.0f}%)",
                     f"{c['b_wait_s']['p50']:.2f}s", f"{c['a_steps_after_abort']['p50']:.0f}",
                     _latency_cell(c)])
    return markdown_table(["Configuration", "Resolution", "Baseline", "Post-abort", "Overhead",
                           "B waited for the DiT", "A's steps after abort",
                           "Abort latency p50 / p99"], rows)


def cancel_summary(report: dict[str, Any]) -> str:
    explicit = report["explicit_cancel"]
    latency, steps = explicit["abort_latency_s"], explicit["steps_after_cancel"]
    computed = explicit["steps_computed_after_cancel"]
    if not latency.get("n"):
        return "explicit cancel: no samples"
    return (f"explicit cancel (step mode, n={latency['n']}): abort latency p50 "
            f"{latency['p50'] * 1e3:.0f} ms, p99 {latency['p99'] * 1e3:.0f} ms; steps completed "
            f"after the last progress the client saw: p50 {steps['p50']:.0f}, max "
            f"{steps['max']:.0f}; steps computed after it (the one in flight, then discarded, "
            f"included): p50 {computed['p50']:.0f}, max {computed['max']:.0f}")


def noise_summary(report: dict[str, Any]) -> str:
    step, machine = report["dit_step_s"], report["machine"]
    cv = max(c["baseline_s"]["cv_pct"] for c in report["configurations"])
    return (f"DiT step p50 {step['p50'] * 1e3:.0f} ms (cv {step['cv_pct']:.0f}%, max "
            f"{step['max'] * 1e3:.0f} ms); baseline cv up to {cv:.0f}%; load average "
            f"{machine['start']['load_average'][0]:.1f} -> {machine['end']['load_average'][0]:.1f}"
            f" on {machine['start']['cpu_count']} CPUs")


def write_chart(report: dict[str, Any], path: Path) -> Path:
    configs = report["configurations"]
    names = [c["key"] for c in configs]
    explicit = report["explicit_cancel"]["abort_latency_s"]
    latency_names = [*names, "explicit cancel"]
    latency_stats = [*(c["abort_latency_s"] for c in configs), explicit]
    return write_bar_chart(path, [
        BarGroup("Latency of the next request (median)", "seconds", names,
                 {"baseline": [c["baseline_s"]["p50"] for c in configs],
                  "post-abort": [c["post_abort_s"]["p50"] for c in configs]},
                 labels=[f"{c['overhead_pct']:+.0f}%" for c in configs]),
        BarGroup("Abort latency (cancel -> state freed)", "milliseconds", latency_names,
                 {"p50": [s.get("p50", 0.0) * 1e3 for s in latency_stats],
                  "p99": [s.get("p99", 0.0) * 1e3 for s in latency_stats]},
                 labels=[*(_latency_note(c) for c in configs), ""]),
    ], suptitle=f"stagemesh bench abort — {report['options']['steps']} steps, "
                f"{configs[0]['resolution']}; {noise_summary(report)}")


# -- command ------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="stagemesh bench abort", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="denoise steps per request")
    parser.add_argument("--size", default="256x256", help="image size WxH (multiple of 16)")
    parser.add_argument("--repeats", type=int, default=3, help="samples per configuration")
    parser.add_argument("--cancels", type=int, default=10,
                        help="explicit step-mode cancels for the abort-latency percentiles")
    parser.add_argument("--abort-fraction", type=float, default=1 / 3,
                        help="abandon request A after this fraction of its steps")
    parser.add_argument("--cfg-scale", type=float, default=4.0,
                        help="true_cfg_scale (> 1: two DiT passes per step, as Qwen-Image)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each stage process (STAGEMESH_THREADS); 1 was "
                             "faster and steadier than 2 on a shared 2-core machine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/abort", help="folder for the results")
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: 8 steps, 64x64, 1 repeat, 2 cancels (about a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.size, args.repeats, args.cancels = 8, "64x64", 1, 2
    try:
        width, height = parse_size(args.size)
    except InvalidRequest as error:
        parser.error(str(error))
    if width % SIZE_MULTIPLE or height % SIZE_MULTIPLE:
        parser.error(f"--size: width and height must be multiples of {SIZE_MULTIPLE}")
    if not 3 <= args.steps <= MAX_STEPS:
        parser.error(f"--steps must be within [3, {MAX_STEPS}]")
    if args.repeats < 1 or args.cancels < 0 or not 0 < args.abort_fraction < 1:
        parser.error("need --repeats >= 1, --cancels >= 0 and 0 < --abort-fraction < 1")
    return Options(steps=args.steps, width=width, height=height, repeats=args.repeats,
                   cancels=args.cancels, abort_fraction=args.abort_fraction,
                   cfg_scale=args.cfg_scale, threads=args.threads, seed=args.seed,
                   out=Path(args.out))


def write_recipe(options: Options, folder: Path) -> Path:
    path = folder / "bench-recipe.yaml"
    path.write_text(RECIPE_TEMPLATE.format(
        name=RECIPE_NAME, width=options.width, height=options.height, steps=options.steps,
        cfg=options.cfg_scale, negative=NEGATIVE_PROMPT, max_steps=MAX_STEPS,
        size_multiple=SIZE_MULTIPLE))
    return path


async def _metrics_urls(http: httpx.AsyncClient) -> dict[str, str]:
    """The DiT and VAE stages' /metrics URLs, from GET /v1/stages."""
    response = await http.get("/v1/stages")
    response.raise_for_status()
    urls = {stage["name"]: str(stage["metrics_url"]) for stage in response.json()["stages"]
            if stage.get("recipe") == RECIPE_NAME and stage.get("metrics_url")}
    missing = {"dit", "vae"} - urls.keys()
    if missing:
        raise RuntimeError(f"GET /v1/stages lists no metrics URL for {sorted(missing)}")
    return {name: urls[name] for name in ("dit", "vae")}


async def measure(base_url: str, options: Options) -> dict[str, Any]:
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as http:
        client = BenchClient(http, options, await _metrics_urls(http))
        return await AbortBenchmark(client, options).run()


def _measure_in_mesh(options: Options) -> dict[str, Any]:
    """Start a mesh for the benchmark, measure, and stop it (also on errors and Ctrl-C)."""
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-") as tmp:
        recipe = write_recipe(options, Path(tmp))
        env = {"STAGEMESH_THREADS": str(options.threads)}
        with serve_mesh(recipe, options.out / "serve.log", env=env) as mesh:
            return asyncio.run(measure(mesh.base_url, options))


def _report(options: Options, measured: dict[str, Any], machine_start: dict[str, Any]) -> None:
    report = build_report(options, measured, machine_start, machine_info())
    write_json(options.out / "abort.json", report)
    write_chart(report, options.out / "abort.png")
    low, high = TARGET_STEP_S
    if not low <= report["dit_step_s"]["p50"] <= high:
        log.warning("DiT step took %.0f ms, outside the %.0f-%.0f ms this benchmark is sized for",
                    report["dit_step_s"]["p50"] * 1e3, low * 1e3, high * 1e3)
    log.info("results in %s\n%s\n%s\n%s", options.out, table(report), cancel_summary(report),
             noise_summary(report))


def main(argv: list[str]) -> None:
    options = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    options.out.mkdir(parents=True, exist_ok=True)
    log.info("bench abort: %d steps at %s, %d repeats, %d explicit cancels, abort after step %d",
             options.steps, options.resolution, options.repeats, options.cancels,
             options.abort_step)
    interrupt_on_sigterm()
    try:
        machine_start = machine_info()
        _report(options, _measure_in_mesh(options), machine_start)
    except KeyboardInterrupt:
        log.warning("interrupted; the mesh is stopped")
        raise SystemExit(130) from None
