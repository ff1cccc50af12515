"""A stage request's trace spans, built from the engine's events as they reach the stream.

The engine runs on its own thread and is never asked to trace: every event it publishes carries
the monotonic time it happened (`at`), and the first progress carries the request's prepare
times, so the stream handler (shared/stage_stream.py) can lay the spans out afterwards, on the
event loop, at their true times:

    <Rpc> (server span, child of the gateway's client span for this stage call)
    ├── queue wait   submit -> prepare starts (or -> the abort, for a request dropped waiting)
    ├── prepare      the adapter's prepare
    ├── steps        first step starts -> last step ends; one `step` event per step
    │                (step_index, total_steps, step_seconds), `preempted` events
    ├── finish       last step -> the result (the adapter's finish)
    └── abort        abort signal -> state released; reason, latency_seconds, step_index

While traces are off, `start_stage_trace` returns `OFF`, whose methods do nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Protocol, TypeAlias

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import Attributes

from stagemesh.shared import tracing
from stagemesh.shared.engine.events import (
    Aborted,
    Completed,
    Failed,
    Partial,
    Preempted,
    Progress,
    Queued,
)

#: How long a stream whose RPC ended before its terminal event is followed for that event
#: (the abort it asked for), so the abort span is recorded; the engine answers within a step.
FOLLOW_TIMEOUT_S = 60.0

#: A gRPC call's metadata, as `ServicerContext.invocation_metadata()` gives it.
Metadata: TypeAlias = Iterable[tuple[str, str | bytes]] | None

_following: set[asyncio.Task[None]] = set()  # tasks of `StageTrace.follow`, kept alive


class StageTrace(Protocol):
    """What the stream handler tells the trace."""

    def observe(self, event: object) -> None:
        """One engine event, as the stream reads it."""

    def end(self, error: str | None = None) -> None:
        """The stream is over (after its terminal event, or with an error status)."""

    def follow(self, events: AsyncIterator[object]) -> None:
        """The RPC ended before the terminal event: read the rest of `events`, then end."""


class _Off:
    """Traces off: every call is a no-op."""

    def observe(self, event: object) -> None:
        pass

    def end(self, error: str | None = None) -> None:
        pass

    def follow(self, events: AsyncIterator[object]) -> None:
        pass


OFF: StageTrace = _Off()


def start_stage_trace(rpc: str, request_id: str, metadata: Callable[[], Metadata]) -> StageTrace:
    """The trace of one stage request, started as it is submitted: a server span continuing the
    trace context in the caller's metadata (read only when traces are on), made current for the
    rest of the RPC's task (so its log lines carry the trace id)."""
    if not tracing.enabled():
        return OFF
    return _Recorder(rpc, request_id, tracing.context_from_metadata(metadata()))


def _ns(monotonic: float) -> int:
    return tracing.epoch_ns(monotonic)


class _Recorder:
    """Spans of one request; see the module docstring for their layout."""

    def __init__(self, rpc: str, request_id: str, parent: Context) -> None:
        self._tracer = tracing.tracer()
        self._server = self._tracer.start_span(
            rpc, context=parent, kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": rpc,
                        "stagemesh.request_id": request_id})
        self._context = trace.set_span_in_context(self._server)
        tracing.attach(self._context)
        self._submitted_at = time.monotonic()
        self._queue_open = True  # the queue wait span is still to be recorded
        self._steps: trace.Span | None = None
        self._last_step_at: float | None = None
        self._ended = False

    def _span(self, name: str, start: float, end: float, attributes: Attributes = None) -> None:
        span = self._tracer.start_span(name, context=self._context, start_time=_ns(start),
                                       attributes=attributes)
        span.end(end_time=_ns(max(start, end)))

    def _close_queue(self, until: float) -> None:
        if self._queue_open:
            self._queue_open = False
            self._span("queue wait", self._submitted_at, until)

    def observe(self, event: object) -> None:
        match event:
            case Queued(position=position):
                self._server.add_event("queued", {"position": position}, _ns(event.at))
            case Progress():
                self._on_progress(event)
            case Preempted(step_index=step_index) if self._steps is not None:
                self._steps.add_event("preempted", {"step_index": step_index}, _ns(event.at))
            case Partial():
                pass
            case Completed(step_index=step_index):
                self._close_steps()
                self._span("finish", self._last_step_at or event.at, event.at)
                self._server.set_attribute("stagemesh.steps", step_index)
            case Aborted():
                self._on_aborted(event)
            case Failed(message=message, field_name=field_name):
                self._close_queue(event.at)
                self._close_steps()
                self._server.add_event("failed", {"message": message,
                                                  "field": field_name or ""}, _ns(event.at))
                self._server.set_status(trace.StatusCode.ERROR, message)

    def _on_progress(self, event: Progress) -> None:
        if self._steps is None:
            step_started = event.at - event.step_seconds
            if event.prepared is not None:
                self._close_queue(event.prepared.started_at)
                self._span("prepare", event.prepared.started_at, event.prepared.ended_at)
            self._close_queue(step_started)  # prepare not told: the queue wait includes it
            self._steps = self._tracer.start_span("steps", context=self._context,
                                                  start_time=_ns(step_started))
        self._steps.add_event("step", {
            "step_index": event.step_index, "total_steps": event.total_steps or 0,
            "step_seconds": event.step_seconds}, _ns(event.at))
        self._last_step_at = event.at

    def _close_steps(self) -> None:
        if self._steps is not None and self._steps.is_recording():
            self._steps.end(end_time=_ns(self._last_step_at or time.monotonic()))

    def _on_aborted(self, event: Aborted) -> None:
        signal_at = event.at - event.abort_latency_seconds
        self._close_queue(signal_at)
        self._close_steps()
        self._span("abort", signal_at, event.at, {
            "stagemesh.abort.reason": event.reason.value,
            "stagemesh.abort.latency_seconds": event.abort_latency_seconds,
            "stagemesh.abort.step_index": event.step_index})
        self._server.set_attribute("stagemesh.steps", event.step_index)

    def end(self, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self._close_steps()
        if error is not None:
            self._server.set_status(trace.StatusCode.ERROR, error)
        self._server.end()

    def follow(self, events: AsyncIterator[object]) -> None:
        task = asyncio.get_running_loop().create_task(self._follow(events))
        _following.add(task)
        task.add_done_callback(_following.discard)

    async def _follow(self, events: AsyncIterator[object]) -> None:
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FOLLOW_TIMEOUT_S):
                    async for event in events:
                        self.observe(event)
        finally:
            self.end()
