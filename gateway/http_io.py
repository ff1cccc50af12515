"""HTTP I/O shared by every REST route: bodies (with a size cap), disconnects, SSE and NDJSON
framing, error responses, and the request id and timeout a transport hands to the core."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.errors import BodyTooLarge, GatewayError, InvalidRequest

T = TypeVar("T")

#: Largest request body any route reads (a voice-clone clip as base64 fits easily).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Inputs larger than this are parsed or decoded in a worker thread (see `off_loop`).
OFF_LOOP_BYTES = 64 * 1024
REQUEST_ID_HEADER = "x-request-id"
TIMEOUT_HEADER = "x-request-timeout"
#: The last SSE event of every stream.
SSE_DONE = b"data: [DONE]\n\n"

JsonObject = dict[str, object]


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def read_body(request: Request) -> bytes:
    """The whole body, refused with a 413 (naming `body`) before it is read when its
    Content-Length is over MAX_BODY_BYTES, or as soon as the bytes read pass it."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > len(str(MAX_BODY_BYTES))
                                                      or int(declared) > MAX_BODY_BYTES):
        raise BodyTooLarge(MAX_BODY_BYTES)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(MAX_BODY_BYTES)
        chunks.append(chunk)
    return b"".join(chunks)


async def off_loop(size: int, call: Callable[[], T]) -> T:
    """`call()` here when its input (`size` bytes) is small, else in a worker thread: parsing
    or decoding megabytes must not stall every other request on the event loop."""
    if size <= OFF_LOOP_BYTES:
        return call()
    return await asyncio.to_thread(call)


async def read_json_object(request: Request) -> JsonObject:
    """The body as a JSON object (an empty body is `{}`); see `parse_json_object`."""
    raw = await read_body(request)
    return await off_loop(len(raw), lambda: parse_json_object(raw))


def _not_json(message: str) -> InvalidRequest:
    return InvalidRequest("body", f"request body is not valid JSON: {message}")


def _refuse_constant(name: str) -> object:
    raise _not_json(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _not_json(f"{text[:20]} is out of the range of a double")
    return value


def parse_json_object(raw: bytes) -> JsonObject:
    """Strict JSON (RFC 8259): UTF-8 only, no NaN/Infinity (nor a number that overflows to
    it, nor an integer of over 4300 digits), an object at the top, and no string that cannot
    be encoded again (a lone surrogate such as "\\ud800" is valid JSON but no valid text;
    the refusal names the top-level field that holds it). Every refusal is a 400."""
    try:
        text = raw.decode("utf-8") if raw else "{}"
    except UnicodeDecodeError as error:
        raise InvalidRequest("body", f"request body is not UTF-8 (byte {error.start})") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:
        raise _not_json("nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, or an integer of over 4300 digits
        raise _not_json(str(error)) from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "request body must be a JSON object")
    if "\\u" in text:  # a surrogate can only come from a \u escape
        _check_encodable(body)
    return body


def _check_encodable(body: JsonObject) -> None:
    """InvalidRequest naming the top-level field whose strings (or keys) hold a lone
    surrogate (iterative: the nesting depth is the client's)."""
    for name, value in body.items():
        if not _encodable(name):
            raise InvalidRequest("body", "a field name is not valid Unicode text")
        stack: list[object] = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                texts: list[str] = [item]
            elif isinstance(item, dict):
                texts = list(item)
                stack.extend(item.values())
            elif isinstance(item, list):
                texts = []
                stack.extend(item)
            else:
                continue
            if not all(map(_encodable, texts)):
                raise InvalidRequest(name, f"{name} is not valid Unicode text (it contains a "
                                     "lone surrogate escape such as \\ud800)")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def error_response(error: GatewayError) -> JSONResponse:
    """The one REST error body (see errors.py) with the mapped HTTP status (and Retry-After
    when the error knows it; admission.py estimates it for any other 429)."""
    headers = {} if error.retry_after is None else {"retry-after": str(error.retry_after)}
    if isinstance(error, BodyTooLarge):  # close: the server must not read the rest of it
        headers["connection"] = "close"
    return JSONResponse(error.body(), status_code=error.http_status, headers=headers)


def _state(request: Request, key: str) -> str:
    value = request.scope.get("state", {}).get(key)
    return value if isinstance(value, str) else ""


def request_id(request: Request) -> str:
    """The id RequestIdMiddleware gave this request (the client's own, if valid)."""
    return _state(request, "request_id")


def owner(request: Request) -> str:
    """The owner id ApiKeyMiddleware found for the caller's key ("" with auth off)."""
    return _state(request, "owner")


def rest_context(request: Request, timeout: object = None) -> RequestContext:
    """The request's id and time budget: `timeout` (seconds, from the body) or the
    x-request-timeout header."""
    value = request.headers.get(TIMEOUT_HEADER) if timeout is None else timeout
    if value is None:
        return RequestContext.create(request_id(request), None, owner(request))
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidRequest("timeout", f"timeout must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidRequest("timeout",
                             f"timeout must be a number of seconds, got {value!r}") from None
    return RequestContext.create(request_id(request), seconds, owner(request))


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
