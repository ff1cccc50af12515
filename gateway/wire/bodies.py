"""Request bodies and what a transport hands to the core, shared by every REST route: the body
under the route's size cap, strict JSON, the request id and timeout, and the error response.

Each route declares its cap beside its request record (TEXT_BODY_BYTES for text-only JSON,
MAX_BODY_BYTES only where images or audio ride in the body): a body over it is refused with a
413 before it is read when Content-Length says so, else as soon as the bytes read pass it, so a
large body on a text route never costs the event loop more than its cap.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.errors import BodyTooLarge, GatewayError, InvalidRequest

T = TypeVar("T")

#: Largest request body any route reads: the routes that carry images or audio (a voice-clone
#: clip or an input image as base64 fits easily).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Largest body of a route whose request is text only (prompts, ids, options): valid ones are
#: a few KB; a megabyte leaves room and costs the loop nothing.
TEXT_BODY_BYTES = 1024 * 1024
#: Inputs larger than this are parsed or decoded in a worker thread (see `off_loop`).
OFF_LOOP_BYTES = 64 * 1024
REQUEST_ID_HEADER = "x-request-id"
TIMEOUT_HEADER = "x-request-timeout"

JsonObject = dict[str, object]


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with a 413 (naming `body`) before it is read when its
    Content-Length is over `limit`, or as soon as the bytes read pass it."""
    check_declared_length(request, limit)
    return b"".join([chunk async for chunk in capped_stream(request, limit)])


def check_declared_length(request: Request, limit: int) -> None:
    """A 413 before any byte is read when Content-Length is over `limit`."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > len(str(limit))
                                                      or int(declared) > limit):
        raise BodyTooLarge(limit)


async def capped_stream(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The body's chunks, raising BodyTooLarge as soon as they pass `limit`."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        yield chunk


async def off_loop(size: int, call: Callable[[], T]) -> T:
    """`call()` here when its input (`size` bytes) is small, else in a worker thread: parsing
    or decoding megabytes must not stall every other request on the event loop."""
    if size <= OFF_LOOP_BYTES:
        return call()
    return await asyncio.to_thread(call)


async def read_json_object(request: Request, limit: int) -> JsonObject:
    """The body (at most `limit` bytes) as a JSON object (an empty body is `{}`); see
    `parse_json_object`."""
    raw = await read_body(request, limit)
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


