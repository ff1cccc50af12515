"""Streamed answers, shared by every REST route: SSE and NDJSON framing with the one in-stream
error path (an error after the first byte is an SSE `error` event then [DONE], or a last NDJSON
line holding the error body), and the time-to-first-audio histogram of streamed speech."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping

from prometheus_client import Histogram
from starlette.responses import StreamingResponse

from stagemesh.gateway.errors import GatewayError

#: The last SSE event of every stream.
SSE_DONE = b"data: [DONE]\n\n"

Payload = Mapping[str, object]

#: Latency buckets of the gateway's histograms (http/metrics.py too).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFP_SECONDS = Histogram(
    "stagemesh_gateway_ttfp_seconds",
    "Streamed speech: from arrival to the first audio bytes being ready, by recipe.",
    ["recipe"], buckets=BUCKETS)


def sse_event(payload: Mapping[str, object]) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def ndjson_line(payload: Mapping[str, object]) -> bytes:
    """One line of a newline-delimited JSON stream."""
    return (json.dumps(payload) + "\n").encode()


def _openai_error(error: GatewayError) -> Payload:
    return error.body()


def sse_response(payloads: AsyncGenerator[Payload, None],
                 error_event: Callable[[GatewayError], Payload] = _openai_error
                 ) -> StreamingResponse:
    """Server-Sent Events: each payload as an event; a GatewayError raised after the first
    byte (the status is already 200) becomes one last `error_event`; always ends with
    [DONE]."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for payload in payloads:
                yield sse_event(payload)
        except GatewayError as error:
            yield sse_event(error_event(error))
        finally:
            await payloads.aclose()  # client gone or done: stop the work behind it
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


def ndjson_response(payloads: AsyncGenerator[Payload, None]) -> StreamingResponse:
    """Newline-delimited JSON: one payload a line; a GatewayError after the first line ends
    the stream with a line holding the error body."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for payload in payloads:
                yield ndjson_line(payload)
        except GatewayError as error:  # the status is already 200: end with an error line
            yield ndjson_line(error.body())
        finally:
            await payloads.aclose()

    return StreamingResponse(body(), media_type="application/x-ndjson")
