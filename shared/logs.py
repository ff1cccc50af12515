"""Structured logging: every record carries the request id of the work it belongs to."""

from __future__ import annotations

import contextvars
import logging
import os

#: The request id of the code currently running (set per RPC / per HTTP request).
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


def configure_logging(component: str, level: str | None = None) -> None:
    """Log as `time level component request_id logger: message` to stderr."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {component} rid=%(request_id)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("STAGEMESH_LOG_LEVEL", "INFO"))
