"""Structured logging: every record carries the request id of the work it belongs to, and the
trace id when a trace span is active (traces on: shared/tracing.py), so a log line leads to its
trace and back."""

from __future__ import annotations

import contextvars
import logging
import os

from opentelemetry import trace

#: The request id of the code currently running (set per RPC / per HTTP request).
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def current_trace_id() -> str | None:
    """The W3C trace id (32 hex digits) of the active span, or None when there is none."""
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None


class _RequestIdFilter(logging.Filter):
    """Adds `request_id`, `trace_id` ("-" without a span) and `trace` (" trace=<id>", or ""
    without a span, so lines look as before while traces are off)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        trace_id = current_trace_id()
        record.trace_id = trace_id or "-"
        record.trace = f" trace={trace_id}" if trace_id else ""
        return True


def configure_logging(component: str, level: str | None = None) -> None:
    """Log as `time level component rid=<request id>[ trace=<trace id>] logger: message`."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {component} rid=%(request_id)s%(trace)s %(name)s: "
        "%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("STAGEMESH_LOG_LEVEL", "INFO"))
