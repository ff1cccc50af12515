"""The event loop every stagemesh server process runs on: asyncio's own, or uvloop on request.

grpc.aio documents only asyncio's default loop, so uvloop was checked here rather than assumed:
grpc.aio servers and clients (unary, streaming, bidi, cancellation, deadlines) work on it with
grpcio 1.85 (the in-process integration suites pass with every test on uvloop). It is not the
default because `stagemesh bench overhead` found it no faster: a request's round trip through
the gateway and the stages, uvloop over asyncio, was 0.94x-1.19x at p50 across workloads and
runs (README, "Event loops"). The mesh's I/O is mostly gRPC's, which its C core does off the
loop, and the rest is Python work in handlers that no loop makes cheaper.
`STAGEMESH_UVLOOP=1` runs the gateway and the stages on uvloop (Unix only; it is a dependency
there), `STAGEMESH_UVLOOP=0` (the default) on asyncio's loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import TypeVar

log = logging.getLogger(__name__)

#: The environment variable that turns uvloop on ("1") or off ("0").
UVLOOP_ENV = "STAGEMESH_UVLOOP"
#: Off: measured no faster here (see the module docstring).
UVLOOP_DEFAULT = False

T = TypeVar("T")


def uvloop_wanted() -> bool:
    """Whether this process should run on uvloop (STAGEMESH_UVLOOP, else UVLOOP_DEFAULT)."""
    value = os.environ.get(UVLOOP_ENV, "").strip().lower()
    if not value:
        return UVLOOP_DEFAULT
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{UVLOOP_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on")


def run(main: Coroutine[object, object, T]) -> T:
    """`asyncio.run(main)`, on uvloop when wanted (and installed), else on asyncio's loop."""
    if uvloop_wanted():
        try:
            import uvloop
        except ImportError:
            log.warning("%s asks for uvloop, which is not installed; running on asyncio's loop",
                        UVLOOP_ENV)
        else:
            return uvloop.run(main)
    return asyncio.run(main)
