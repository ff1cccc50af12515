"""The gateway's own Prometheus metrics: request latency by route (and, from wire/streams.py,
time to first audio), served at /metrics."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from stagemesh.gateway.wire.streams import BUCKETS
from stagemesh.shared.interception import HttpMiddleware

REQUEST_SECONDS = Histogram(
    "stagemesh_gateway_request_seconds",
    "REST requests, from arrival to the last byte of the response, by route and status.",
    ["route", "status"], buckets=BUCKETS)


class RequestMetricsMiddleware(HttpMiddleware):
    """Times every HTTP request under its route template (not the raw path: ids stay out)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        status = {"code": 500}

        async def send_with_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            REQUEST_SECONDS.labels(route=route, status=str(status["code"])).observe(
                time.monotonic() - started)


async def metrics_endpoint(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
