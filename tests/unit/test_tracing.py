"""Traces without a mesh: when the OTEL_* environment turns them on, how a stage request's spans
are laid out from engine events, how context crosses a stage call, and the log lines' trace id.

Spans go to the SDK's in-memory exporter through a provider of the test's own
(`tracing.use_tracer_provider`), so the process-wide provider is never touched. A stage trace
makes its span current for the rest of its task (as in a stage, where each RPC is a task), so
the tests that start one are async: each runs in its own task and context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from stagemesh.shared import logs, stage_trace, tracing
from stagemesh.shared.engine.events import (
    Aborted,
    Completed,
    PrepareTiming,
    Progress,
    Queued,
)
from stagemesh.shared.engine.request import AbortReason

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
OTEL_VARIABLES = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    yield exporter
    tracing.use_tracer_provider(None)


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named


# -- when traces are on --------------------------------------------------------------------


@pytest.mark.parametrize(("variables", "exporter"), [
    ({}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "otlp"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, "otlp"),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
    ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, None),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None),
])
def test_the_environment_decides_whether_traces_are_on(
        clean_env: pytest.MonkeyPatch, variables: dict[str, str], exporter: str | None) -> None:
    for name, value in variables.items():
        clean_env.setenv(name, value)
    assert tracing.exporter_asked_for() == exporter


def test_the_protocol_is_http_unless_grpc_is_named(clean_env: pytest.MonkeyPatch) -> None:
    assert tracing.otlp_protocol() == "http/protobuf"
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert tracing.otlp_protocol() == "grpc"
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        tracing.otlp_protocol()


def test_unset_means_off_and_nothing_is_traced(clean_env: pytest.MonkeyPatch) -> None:
    assert tracing.setup("dit") is False
    assert not tracing.enabled()
    assert tracing.outgoing_metadata() == ()
    assert stage_trace.start_stage_trace("Denoise", "r1", lambda: pytest.fail(
        "metadata must not be read while traces are off")) is stage_trace.OFF


# -- a stage request's spans, from engine events ----------------------------------------------


def _metadata() -> tuple[tuple[str, str], ...]:
    return (("x-request-id", "r1"), ("traceparent", TRACEPARENT))


async def test_a_completed_request_gives_queue_prepare_steps_and_finish_spans(
        exported: InMemorySpanExporter) -> None:
    t0 = time.monotonic()
    recorder = stage_trace.start_stage_trace("Denoise", "r1", _metadata)
    prepared = PrepareTiming(t0 + 0.010, t0 + 0.015)
    recorder.observe(Queued(0, at=t0 + 0.001))
    for step in (1, 2, 3):
        recorder.observe(Progress(step, 3, 0.02, 0.1, prepared=prepared,
                                  at=t0 + 0.015 + 0.02 * step))
    recorder.observe(Completed("latents", 3, at=t0 + 0.080))
    recorder.end()

    spans = by_name(exported)
    assert set(spans) == {"Denoise", "queue wait", "prepare", "steps", "finish"}
    server = spans["Denoise"]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_SPAN_ID
    assert server.kind is trace.SpanKind.SERVER
    assert server.attributes is not None and server.attributes["stagemesh.steps"] == 3
    for name in ("queue wait", "prepare", "steps", "finish"):
        parent = spans[name].parent
        assert parent is not None and parent.span_id == server.context.span_id, name
    steps = spans["steps"]
    assert [event.name for event in steps.events] == ["step", "step", "step"]
    assert [dict(event.attributes or {})["step_index"] for event in steps.events] == [1, 2, 3]

    def ms(span: ReadableSpan) -> tuple[float, float]:
        assert span.start_time is not None and span.end_time is not None
        start = (span.start_time - tracing.epoch_ns(t0)) / 1e6
        return round(start, 1), round((span.end_time - span.start_time) / 1e6, 1)

    # submit (the server span's start: the real time the trace began, a little after t0 on a
    # busy machine) -> prepare (t0 + 10 ms)
    queue_start, queue_ms = ms(spans["queue wait"])
    assert queue_start == pytest.approx(ms(server)[0], abs=0.5)
    assert queue_start + queue_ms == pytest.approx(10, abs=0.5)
    assert ms(spans["prepare"]) == pytest.approx((10, 5), abs=0.5)
    assert ms(spans["steps"]) == pytest.approx((15, 60), abs=0.5)  # first step -> last step
    assert ms(spans["finish"]) == pytest.approx((75, 5), abs=0.5)


async def test_a_request_aborted_while_queued_gives_queue_wait_and_abort_spans(
        exported: InMemorySpanExporter) -> None:
    t0 = time.monotonic()
    recorder = stage_trace.start_stage_trace("Denoise", "r1", _metadata)
    recorder.observe(Queued(2, at=t0 + 0.001))
    recorder.observe(Aborted(0, AbortReason.CANCELLED, 0.004, at=t0 + 0.050))
    recorder.end()

    spans = by_name(exported)
    assert set(spans) == {"Denoise", "queue wait", "abort"}
    abort = spans["abort"]
    assert dict(abort.attributes or {}) == {"stagemesh.abort.reason": "cancelled",
                                            "stagemesh.abort.latency_seconds": 0.004,
                                            "stagemesh.abort.step_index": 0}
    assert abort.end_time is not None and abort.start_time is not None
    assert (abort.end_time - abort.start_time) / 1e9 == pytest.approx(0.004, abs=1e-4)
    queue = spans["queue wait"]
    assert queue.end_time == pytest.approx(abort.start_time, abs=1e5)


async def test_an_rpc_that_ends_early_still_records_the_abort_it_asked_for(
        exported: InMemorySpanExporter) -> None:
    t0 = time.monotonic()
    recorder = stage_trace.start_stage_trace("GenerateFrames", "r1", _metadata)
    recorder.observe(Progress(1, None, 0.01, 0.02, at=t0 + 0.02))

    async def rest() -> AsyncIterator[object]:
        await asyncio.sleep(0)
        yield Aborted(1, AbortReason.RPC_CANCELLED, 0.003, at=time.monotonic())

    recorder.follow(rest())
    assert "GenerateFrames" not in by_name(exported), "the server span waits for the abort"
    for _ in range(100):
        if "GenerateFrames" in by_name(exported):
            break
        await asyncio.sleep(0.01)
    spans = by_name(exported)
    assert {"GenerateFrames", "queue wait", "steps", "abort"} == set(spans)
    assert dict(spans["abort"].attributes or {})["stagemesh.abort.reason"] == "rpc_cancelled"


# -- across a stage call, and in the log lines ---------------------------------------------


async def test_a_stage_call_is_a_client_span_whose_context_travels_in_the_metadata(
        exported: InMemorySpanExporter) -> None:
    seen: list[tuple[tuple[str, str], ...]] = []

    @tracing.traced_stage_call
    async def call(scope: object, stage: str, payload: int) -> int:
        seen.append(tracing.outgoing_metadata())
        return payload + 1

    assert await call(object(), "dit", 41) == 42
    client = by_name(exported)["stage dit"]
    assert client.kind is trace.SpanKind.CLIENT
    (sent,) = seen
    traceparent = dict(sent)["traceparent"]
    assert traceparent.split("-")[1:3] == [format(client.context.trace_id, "032x"),
                                          format(client.context.span_id, "016x")]
    context = tracing.context_from_metadata([*sent, ("x-request-id", "r1")])
    assert trace.get_current_span(context).get_span_context().span_id == client.context.span_id


async def test_rest_requests_get_a_server_span_named_by_route(
        exported: InMemorySpanExporter) -> None:
    async def item(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/items/{item_id}", item)])
    app.add_middleware(tracing.TracingMiddleware)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.get("/v1/items/abc", headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    span = by_name(exported)["GET /v1/items/{item_id}"]
    assert span.kind is trace.SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert dict(span.attributes or {})["http.response.status_code"] == 200


def test_log_lines_carry_the_trace_id_while_a_span_is_active(
        exported: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> None:
    formatter = logging.Formatter("rid=%(request_id)s%(trace)s %(message)s")
    log_filter = logs._RequestIdFilter()

    def line(message: str) -> str:
        record = logging.LogRecord("t", logging.INFO, __file__, 1, message, None, None)
        log_filter.filter(record)
        return formatter.format(record)

    assert line("outside") == "rid=- outside"
    with tracing.tracer().start_as_current_span("work") as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
        assert line("inside") == f"rid=- trace={trace_id} inside"
