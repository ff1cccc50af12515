"""HTTP I/O shared by every REST route: bodies (with a size cap), disconnects, SSE and NDJSON
framing, error responses, and the request id and timeout a transport hands to the core."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.errors import GatewayError, InvalidRequest

T = TypeVar("T")

#: Largest request body any route reads (a voice-clone clip as base64 fits easily).
MAX_BODY_BYTES = 32 * 1024 * 1024
REQUEST_ID_HEADER = "x-request-id"
TIMEOUT_HEADER = "x-request-timeout"
#: The last SSE event of every stream.
SSE_DONE = b"data: [DONE]\n\n"

JsonObject = dict[str, object]


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def read_body(request: Request) -> bytes:
    """The whole body, refused (naming `body`) as soon as it passes MAX_BODY_BYTES."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise InvalidRequest("body", f"request body larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request) -> JsonObject:
    """The body as a JSON object (an empty body is `{}`)."""
    raw = await read_body(request)
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError as error:
        raise InvalidRequest("body", f"request body is not valid JSON: {error}") from None
    except UnicodeDecodeError:
        raise InvalidRequest("body", "request body is not UTF-8 JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "request body must be a JSON object")
    return body


def error_response(error: GatewayError) -> JSONResponse:
    """The one REST error body (see errors.py) with the mapped HTTP status."""
    return JSONResponse(error.body(), status_code=error.http_status)


def request_id(request: Request) -> str:
    """The id RequestIdMiddleware gave this request (the client's own, if valid)."""
    given = request.scope.get("state", {}).get("request_id")
    return given if isinstance(given, str) else ""


def rest_context(request: Request, timeout: object = None) -> RequestContext:
    """The request's id and time budget: `timeout` (seconds, from the body) or the
    x-request-timeout header."""
    value = request.headers.get(TIMEOUT_HEADER) if timeout is None else timeout
    if value is None:
        return RequestContext.create(request_id(request), None)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidRequest("timeout", f"timeout must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidRequest("timeout",
                             f"timeout must be a number of seconds, got {value!r}") from None
    return RequestContext.create(request_id(request), seconds)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (and raise ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.create_task(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone()
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()


def sse_event(payload: Mapping[str, object]) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def ndjson_line(payload: Mapping[str, object]) -> bytes:
    """One line of a newline-delimited JSON stream."""
    return (json.dumps(payload) + "\n").encode()
