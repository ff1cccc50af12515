"""The gateway's concurrency limit: at most `limit` requests running at once, the rest refused
at once with 429 / RESOURCE_EXHAUSTED and a Retry-After estimate.

Refusing early is cheaper than queueing: a request over the limit costs no body read, no
stage call and no memory. The default limit is what the stages can hold: for each recipe, the
smallest `max_pending` its stages publish (a request holds a place in each of them), summed
over the recipes, re-read every LIMIT_REFRESH_S (a stage may come back with other options).
An operator's `--max-concurrent-requests` replaces it.

Retry-After (whole seconds, at least 1) is estimated from the queue and recent latency: with
`limit` requests running and a recent mean duration L, a slot frees about every L / limit
seconds, and a caller waits for the requests ahead of it. The same estimate goes on every other
429 the gateway answers (a stage's queue is full) that carries none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.errors import Overloaded
from stagemesh.gateway.wire.auth import ADMIN_PATHS
from stagemesh.gateway.wire.requests import error_response
from stagemesh.shared.interception import HttpMiddleware

log = logging.getLogger(__name__)

#: The limit while the stages' queue sizes are unknown (a stage could not be read yet).
FALLBACK_LIMIT = 64
LIMIT_REFRESH_S = 30.0
RESIZE_RETRY_S = 2.0
#: Weight of the newest request duration in the running mean.
LATENCY_WEIGHT = 0.2
#: Retry-After bounds, seconds.
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 120
RETRY_AFTER = b"retry-after"


class Admission:
    """Counts running requests against a limit and keeps a running mean of their duration."""

    def __init__(self, core: GatewayCore | None, limit: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"the concurrency limit must be at least 1, got {limit}")
        self.core = core
        self.fixed = limit is not None or core is None
        self.limit = limit if limit is not None else FALLBACK_LIMIT
        self.running = 0
        self.mean_seconds: float | None = None
        self._clock = clock
        self._sized_at = -math.inf
        self._sizing: asyncio.Task[None] | None = None

    def retry_after(self) -> int:
        """Seconds until a slot is likely free (see the module docstring)."""
        if self.mean_seconds is None:
            return MIN_RETRY_AFTER_S
        ahead = max(1, self.running - self.limit + 1)
        wait = self.mean_seconds * ahead / self.limit
        return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(wait))))

    def check(self) -> None:
        """Overloaded (429) when every slot is taken."""
        if self.running >= self.limit:
            raise Overloaded(self.limit, self.retry_after())

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one place for the life of the block (`check` first)."""
        self.check()
        self.running += 1
        started = self._clock()
        try:
            yield
        finally:
            self.running -= 1
            self._observe(self._clock() - started)
            self._resize()  # after a request: the facts it needed are read by then

    def _observe(self, seconds: float) -> None:
        previous = self.mean_seconds
        self.mean_seconds = seconds if previous is None else (
            previous + LATENCY_WEIGHT * (seconds - previous))

    def _resize(self) -> None:
        """Re-size the default limit from what the stages publish, in the background (a stage
        that does not answer must not delay the request), at most every LIMIT_REFRESH_S."""
        now = self._clock()
        busy = self._sizing is not None and not self._sizing.done()
        if self.fixed or busy or now - self._sized_at < LIMIT_REFRESH_S:
            return
        self._sized_at = now
        self._sizing = asyncio.create_task(self._size())

    async def _size(self) -> None:
        """Sum over the recipes of the smallest max_pending of their stages; a stage that
        cannot be read (or a mesh closing under us) leaves the limit and retries soon."""
        assert self.core is not None
        core = self.core
        limits = []
        try:
            for recipe in core.recipes.values():
                stages = [await core.catalog.description(e) for e in recipe.stages.values()]
                pending = [d.max_pending for d in stages if d is not None and d.max_pending > 0]
                if len(pending) < len(stages):
                    raise LookupError(f"a stage of recipe {recipe.name} is unreadable")
                limits.append(min(pending))
        except (LookupError, RuntimeError) as error:
            log.debug("concurrency limit not re-sized: %s", error)
            self._sized_at = self._clock() - LIMIT_REFRESH_S + RESIZE_RETRY_S
            return
        if limits and sum(limits) != self.limit:
            log.info("gateway concurrency limit: %d requests (from the stages' queues)",
                     sum(limits))
            self.limit = sum(limits)


def starts_work(scope: Scope) -> bool:
    """Does this REST call start a request (and so take a slot)? Every POST but cancel-by-id,
    which frees capacity instead, and the admin routes (an operator's call must pass a busy
    gateway)."""
    path = scope["path"]
    return scope["method"] == "POST" and not path.endswith("/cancel") and path not in ADMIN_PATHS


class AdmissionMiddleware(HttpMiddleware):
    """REST: every request that starts work holds a slot until its response (a stream too)
    has been sent; every 429 leaving the gateway carries Retry-After."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        super().__init__(app)
        self.admission = admission

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:

        async def send_with_retry_after(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                headers = list(message.get("headers", []))
                if all(key.lower() != RETRY_AFTER for key, _ in headers):
                    headers.append((RETRY_AFTER, str(self.admission.retry_after()).encode()))
                message["headers"] = headers
            await send(message)

        if not starts_work(scope):
            await self.app(scope, receive, send_with_retry_after)
            return
        try:
            self.admission.check()
        except Overloaded as error:
            await error_response(error)(scope, receive, send)
            return
        with self.admission.slot():
            await self.app(scope, receive, send_with_retry_after)
