"""Prometheus metrics of one stage engine, labelled by `stage`.

The metric families are created once per CollectorRegistry and shared by every engine that
uses it (each engine takes its own `stage` label), so several engines in one process, or one
test after another, never register a name twice.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from stagemesh.shared.engine.events import Aborted, Completed, Failed, Terminal

#: The `status` label of stagemesh_requests_finished_total, per terminal event.
FINISH_STATUS: dict[type[Terminal[object]], str] = {
    Completed: "completed",
    Aborted: "aborted",
    Failed: "failed",
}

# From a fast tokenizer step (ms) to a long queue wait (minutes).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


@dataclass(frozen=True)
class _Families:
    waiting: Gauge
    running: Gauge
    preempted: Gauge
    finished: Counter
    steps: Counter
    step_seconds: Histogram
    queue_seconds: Histogram
    abort_latency: Histogram
    preemptions: Counter
    forward_interrupts: Counter
    isolated_step_failures: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> _Families:
        stage = ["stage"]

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, stage, buckets=LATENCY_BUCKETS, registry=registry)

        return cls(
            waiting=Gauge(
                "stagemesh_requests_waiting",
                "Requests queued for a run slot, not running (preempted ones included)", stage,
                registry=registry,
            ),
            running=Gauge(
                "stagemesh_requests_running", "Requests admitted to run", stage, registry=registry
            ),
            preempted=Gauge(
                "stagemesh_requests_preempted",
                "Requests paused for more urgent ones, holding their state", stage,
                registry=registry,
            ),
            finished=Counter(
                "stagemesh_requests_finished_total", "Requests that left the engine",
                [*stage, "status"], registry=registry,
            ),
            steps=Counter(
                "stagemesh_steps_total", "Request-steps executed (one per request per step call)",
                stage, registry=registry,
            ),
            step_seconds=histogram("stagemesh_step_seconds", "Duration of one step call"),
            queue_seconds=histogram(
                "stagemesh_queue_seconds", "From submit to first scheduled"
            ),
            abort_latency=histogram(
                "stagemesh_abort_latency_seconds", "From the abort signal to the state's release"
            ),
            preemptions=Counter(
                "stagemesh_preemptions_total",
                "Running requests paused at a step boundary for a more urgent one", stage,
                registry=registry,
            ),
            forward_interrupts=Counter(
                "stagemesh_forward_interrupts_total",
                "Step calls stopped part-way because every request in them was cancelled",
                stage, registry=registry,
            ),
            isolated_step_failures=Counter(
                "stagemesh_isolated_step_failures_total",
                "Batched step calls that raised and were rerun one request at a time",
                stage, registry=registry,
            ),
        )  # fmt: skip


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _families_for(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        families = _families.get(registry)
        if families is None:
            families = _families[registry] = _Families.register(registry)
        return families


class EngineMetrics:
    """The engine's view of its metrics: one method per thing it observes."""

    def __init__(self, stage: str, registry: CollectorRegistry | None = None) -> None:
        families = _families_for(REGISTRY if registry is None else registry)
        self.stage = stage
        self._waiting = families.waiting.labels(stage=stage)
        self._running = families.running.labels(stage=stage)
        self._finished = {
            kind: families.finished.labels(stage=stage, status=status)
            for kind, status in FINISH_STATUS.items()
        }
        self._steps = families.steps.labels(stage=stage)
        self._step_seconds = families.step_seconds.labels(stage=stage)
        self._queue_seconds = families.queue_seconds.labels(stage=stage)
        self._abort_latency = families.abort_latency.labels(stage=stage)
        self._preempted = families.preempted.labels(stage=stage)
        self._preemptions = families.preemptions.labels(stage=stage)
        self._forward_interrupts = families.forward_interrupts.labels(stage=stage)
        self._isolated_step_failures = families.isolated_step_failures.labels(stage=stage)

    def observe_queues(self, num_waiting: int, num_running: int, num_preempted: int = 0) -> None:
        self._waiting.set(num_waiting)
        self._running.set(num_running)
        self._preempted.set(num_preempted)

    def observe_preemption(self) -> None:
        self._preemptions.inc()

    def observe_forward_interrupt(self) -> None:
        self._forward_interrupts.inc()

    def observe_isolated_step_failure(self) -> None:
        self._isolated_step_failures.inc()

    def observe_step(self, seconds: float, num_requests: int) -> None:
        self._step_seconds.observe(seconds)
        self._steps.inc(num_requests)

    def observe_queue_time(self, seconds: float) -> None:
        self._queue_seconds.observe(seconds)

    def observe_terminal(self, event: Terminal[object]) -> None:
        self._finished[type(event)].inc()
        if isinstance(event, Aborted):
            self._abort_latency.observe(event.abort_latency_seconds)
