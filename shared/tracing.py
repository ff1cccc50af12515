"""Traces: one trace per request across the gateway and every stage it touches (OpenTelemetry).

Off unless the standard OpenTelemetry environment asks for it, and then exported over OTLP:

- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, or
  `OTEL_TRACES_EXPORTER=otlp` (or `console`, spans printed to stderr), turns traces on;
  `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true` keeps them off whatever else is set;
- `OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_PROTOCOL`): `http/protobuf` (the default) or
  `grpc`; every other `OTEL_*` variable (headers, timeouts, `OTEL_BSP_*` batching,
  `OTEL_RESOURCE_ATTRIBUTES`) is read by the SDK itself.

Each process calls `setup(component)` once at start; its spans carry the resource attribute
`service.name = stagemesh-<component>` (`stagemesh-gateway`, `stagemesh-dit`, ...). While off,
nothing here allocates a span or reads a header: every entry point first checks `enabled()`.

How one trace crosses the mesh: the gateway opens a server span per REST request
(`TracingMiddleware`) or public gRPC call (`GrpcServerSpans`), a client span per stage call
(`traced_stage_call`), and puts the W3C `traceparent` of that client span into the stage call's
metadata (`outgoing_metadata`); the stage continues the trace from it
(`context_from_metadata`; its spans are built in `shared/stage_trace.py`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Concatenate, ParamSpec, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Message, Receive, Scope, Send

from stagemesh.shared.interception import HandlerInterceptor, HttpMiddleware
from stagemesh.shared.mesh_auth import is_infrastructure

log = logging.getLogger(__name__)

#: `service.name` of a process is this prefix + its component (gateway, tokenizer, dit, ...).
SERVICE_PREFIX = "stagemesh-"
#: The instrumentation scope name of every span stagemesh makes.
TRACER_NAME = "stagemesh"
#: Exporter protocols `OTEL_EXPORTER_OTLP_PROTOCOL` may name.
PROTOCOLS = ("http/protobuf", "grpc")

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C trace context: traceparent + tracestate
_tracer: trace.Tracer | None = None  # set by setup() when traces are on

P = ParamSpec("P")
R = TypeVar("R")
ScopeT = TypeVar("ScopeT")
RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")


# -- setup --------------------------------------------------------------------------------------


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def exporter_asked_for() -> str | None:
    """The exporter the environment asks for ("otlp" or "console"), or None: traces off."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    named = _env("OTEL_TRACES_EXPORTER").lower()
    if named in ("otlp", "console"):
        return named
    if named:  # "none", or an exporter this build does not ship
        if named != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console); traces off",
                        named)
        return None
    endpoint = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")
    return "otlp" if endpoint else None


def otlp_protocol() -> str:
    """The OTLP protocol the environment names (http/protobuf unless it says grpc)."""
    protocol = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf")
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}, "
                         f"got {protocol!r}")
    return protocol


def setup(component: str) -> bool:
    """Configure this process's tracer provider if the environment asks; True when traces are on.

    Call once, at start, before serving. The SDK is imported only then, so a process without
    traces never loads it. Spans are batched (OTEL_BSP_*) and flushed at exit.
    """
    exporter_name = exporter_asked_for()
    if exporter_name is None:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    exporter: SpanExporter
    if exporter_name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        exporter = ConsoleSpanExporter()
    elif otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )
        exporter = HttpSpanExporter()
    service = SERVICE_PREFIX + component
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    use_tracer_provider(provider)
    log.info("traces on: service.name=%s, exporter %s", service,
             exporter_name if exporter_name == "console" else f"otlp ({otlp_protocol()})")
    return True


def use_tracer_provider(provider: trace.TracerProvider | None) -> None:
    """Trace with `provider` from now on (setup's, a test's, or a host application's own);
    None turns traces off again."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer(TRACER_NAME)


def enabled() -> bool:
    return _tracer is not None


def tracer() -> trace.Tracer:
    """This process's tracer; call only when `enabled()`."""
    assert _tracer is not None, "traces are off: check tracing.enabled() first"
    return _tracer


def epoch_ns(monotonic: float) -> int:
    """A `time.monotonic()` value as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


# -- propagation ----------------------------------------------------------------------------


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current span's W3C trace context (empty when traces are off)."""
    if _tracer is None:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a caller sent in gRPC metadata (an empty context if it sent none)."""
    carrier = {key: value for key, value in metadata or ()
               if isinstance(value, str) and key in _PROPAGATOR.fields}
    return _PROPAGATOR.extract(carrier)


def _context_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> Context:
    fields = _PROPAGATOR.fields
    carrier = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in headers
               if key.decode("latin-1").lower() in fields}
    return _PROPAGATOR.extract(carrier)


# -- gateway: a client span per stage call --------------------------------------------------


def traced_stage_call(
    call: Callable[Concatenate[ScopeT, str, P], Awaitable[R]],
) -> Callable[Concatenate[ScopeT, str, P], Coroutine[object, object, R]]:
    """Wraps `call_stage(scope, stage, ...)` in a client span named for the stage.

    The span is current while the call runs, so `outgoing_metadata()` inside it hands the stage
    this span as its parent. A cancel or an error ends the span with the exception recorded.
    """

    @functools.wraps(call)
    async def traced(scope: ScopeT, stage: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if _tracer is None:
            return await call(scope, stage, *args, **kwargs)
        with _tracer.start_as_current_span(f"stage {stage}", kind=trace.SpanKind.CLIENT,
                                           attributes={"stagemesh.stage": stage,
                                                       "rpc.system": "grpc"}):
            return await call(scope, stage, *args, **kwargs)

    return traced


# -- gateway: a server span per REST request ------------------------------------------------


class TracingMiddleware(HttpMiddleware):
    """A server span per HTTP request, continuing the client's `traceparent` if it sent one.

    Sits inside the request-id middleware (it reads the id from `scope["state"]`) and names the
    span by route template once routing has matched (`POST /v1/images/generations`), so ids in
    paths stay out of span names.
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _tracer is None:
            await self.app(scope, receive, send)
            return
        method = str(scope.get("method", "GET"))
        attributes: dict[str, str] = {"http.request.method": method,
                                      "url.path": str(scope.get("path", ""))}
        request_id = scope.get("state", {}).get("request_id")
        if isinstance(request_id, str):
            attributes["stagemesh.request_id"] = request_id
        parent = _context_from_headers(scope.get("headers", []))
        with _tracer.start_as_current_span(method, context=parent, kind=trace.SpanKind.SERVER,
                                           attributes=attributes) as span:

            async def send_with_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(trace.StatusCode.ERROR)
                await send(message)

            try:
                await self.app(scope, receive, send_with_status)
            finally:
                route = getattr(scope.get("route"), "path", None)
                if isinstance(route, str):
                    span.set_attribute("http.route", route)
                    span.update_name(f"{method} {route}")


# -- gateway: a server span per public gRPC call ----------------------------------------------


#: A handler's behaviour: (request or request iterator, context) -> response, coroutine or
#: async iterator of responses. grpc types it as a plain callable.
Behavior = Callable[[object, object], object]


def _streaming_in_span(behavior: Behavior, start: Callable[[], trace.Span]) -> Behavior:
    async def streaming(request: object, context: object) -> AsyncIterator[object]:
        responses = behavior(request, context)
        assert isinstance(responses, AsyncIterator), "a streaming handler yields responses"
        with trace.use_span(start(), end_on_exit=True):
            async for response in responses:
                yield response

    return streaming


def _unary_in_span(behavior: Behavior, start: Callable[[], trace.Span]) -> Behavior:
    async def unary(request: object, context: object) -> object:
        with trace.use_span(start(), end_on_exit=True):
            response = behavior(request, context)
            return await response if inspect.isawaitable(response) else response

    return unary


#: handler attribute -> (the factory that rebuilds such a handler, whether it streams responses)
_HANDLER_KINDS = {
    "unary_unary": (grpc.unary_unary_rpc_method_handler, False),
    "unary_stream": (grpc.unary_stream_rpc_method_handler, True),
    "stream_unary": (grpc.stream_unary_rpc_method_handler, False),
    "stream_stream": (grpc.stream_stream_rpc_method_handler, True),
}


class GrpcServerSpans(HandlerInterceptor):
    """A grpc.aio server interceptor: a server span around every call of the gateway's API.

    Pass it (with any other interceptors) to `start_server`; while traces are off it hands the
    handler back untouched. Health and reflection calls get no span.
    """

    def intercept(self, handler: grpc.RpcMethodHandler[RequestT, ResponseT] | None,
                  handler_call_details: grpc.HandlerCallDetails,
                  ) -> grpc.RpcMethodHandler[RequestT, ResponseT] | None:
        method = handler_call_details.method
        if _tracer is None or handler is None or is_infrastructure(method):
            return handler
        metadata = {key: value for key, value in handler_call_details.invocation_metadata or ()
                    if isinstance(value, str)}
        return _wrap_handler(handler, method.lstrip("/"), metadata)


def _wrap_handler(handler: grpc.RpcMethodHandler[RequestT, ResponseT], method: str,
                  metadata: Mapping[str, str]) -> grpc.RpcMethodHandler[RequestT, ResponseT]:
    """The same handler, its behaviour run inside a server span continuing the caller's trace."""
    attributes = {"rpc.system": "grpc", "rpc.method": method}
    if request_id := metadata.get("x-request-id"):
        attributes["stagemesh.request_id"] = request_id
    parent = _PROPAGATOR.extract(dict(metadata))

    def start() -> trace.Span:
        return tracer().start_span(method, context=parent, kind=trace.SpanKind.SERVER,
                                   attributes=attributes)

    for attribute, (factory, streaming) in _HANDLER_KINDS.items():
        behavior: Behavior | None = getattr(handler, attribute, None)
        if behavior is not None:
            wrapped = (_streaming_in_span if streaming else _unary_in_span)(behavior, start)
            return factory(wrapped, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    return handler


def attach(ctx: Context) -> None:
    """Make `ctx` current for the rest of the running task (a stage RPC's own task).

    The token is dropped on purpose: the context dies with the RPC's task, as the request id
    does (shared/logs.py), and detaching from a generator finalised elsewhere would fail.
    """
    otel_context.attach(ctx)
