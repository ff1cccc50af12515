"""The request as it arrives, shared by every REST route: its body under the route's size cap,
strict JSON, typed fields and data URLs, the request id and timeout a transport hands to the
core, the error response, and the work that stops when the client leaves.

Each route declares its cap beside its request record (TEXT_BODY_BYTES for text-only JSON,
MAX_BODY_BYTES only where images or audio ride in the body): a body over it is refused with a
413 before it is read when Content-Length says so, else as soon as the bytes read pass it, so a
large body on a text route never costs the event loop more than its cap.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import math
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TypeVar

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse

from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.errors import HTTP_STATUS, BodyTooLarge, GatewayError, InvalidRequest
from stagemesh.gateway.mesh.stages import DEFAULT_SCALE, LoraChoice, refuse_lora

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


# -- typed fields and data URLs -------------------------------------------------------------------

DATA_URL_PREFIX = "data:"
#: Longest data URL header read (image and audio data URLs: the header regexes run on at most
#: this many characters).
MAX_DATA_URL_HEADER_CHARS = 256
#: The header of an image's base64 data URL: `data:image/<type>[;param]...;base64,`.
_IMAGE_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+(;[^,;]*)*;base64,", re.ASCII)
#: A data URL's header (after `data:`, before the comma): an optional media type, optional
#: `;name=value` parameters, then `;base64`. Only ever matched on at most
#: MAX_DATA_URL_HEADER_CHARS characters, and unambiguous (parameters start at `;`).
_DATA_URL_HEADER = re.compile(r"[\w.+/-]*(?:;[\w.+-]+=[\w.+-]*)*;base64")


class JsonFields:
    """Typed reads of a JSON object's fields: None when absent (or null); a value of the wrong
    type is a 400 naming the field."""

    def __init__(self, body: Mapping[str, object]) -> None:
        self.body = body

    def _refuse(self, name: str, kind: str) -> InvalidRequest:
        return InvalidRequest(name, f"{name} must be of type {kind}")

    def string(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, str):
            raise self._refuse(name, "str")
        return value

    def integer(self, name: str) -> int | None:
        value = self.body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise self._refuse(name, "int")
        return value

    def number(self, name: str) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._refuse(name, "number")
        return float(value)

    def boolean(self, name: str) -> bool | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, bool):
            raise self._refuse(name, "bool")
        return value


def openai_body(body: JsonObject) -> JsonObject:
    """The body with a literal `extra_body` object merged in (curl users copying SDK code)."""
    extra = body.get("extra_body")
    rest = {key: value for key, value in body.items() if key != "extra_body"}
    return {**rest, **extra} if isinstance(extra, dict) else rest


def ref_audio_bytes(value: str) -> bytes:
    """A data URL (`data:audio/wav;base64,...`) or bare base64 -> the file's bytes.

    Remote URLs are refused: the gateway never fetches from the network on a client's behalf.
    Parsing is linear in the input (no regex over the payload), so a large or odd value costs
    one pass; callers decode megabytes off the event loop (`off_loop`).
    """
    value = value.strip()
    if value.startswith(("http://", "https://", "file:")):
        raise InvalidRequest("ref_audio", "ref_audio must be a data URL or base64, not a URL")
    payload = _data_url_payload(value) if value.startswith(DATA_URL_PREFIX) else value
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("ref_audio", "ref_audio is not valid base64") from None


def _data_url_payload(value: str) -> str:
    """The payload of `data:[media type][;name=value]...;base64,PAYLOAD` (RFC 2397); the
    header before the comma is at most MAX_DATA_URL_HEADER_CHARS long."""
    comma = value.find(",", 0, MAX_DATA_URL_HEADER_CHARS + 1)
    if comma < 0:
        raise InvalidRequest("ref_audio", "ref_audio is a data URL without a ',' in its first "
                             f"{MAX_DATA_URL_HEADER_CHARS} characters")
    header = value[len(DATA_URL_PREFIX):comma]
    if not _DATA_URL_HEADER.fullmatch(header):
        raise InvalidRequest("ref_audio", "ref_audio's data URL header must look like "
                             "'data:audio/wav;base64,'")
    return value[comma + 1:]


def image_data_url(url: str, field: str) -> bytes:
    """The bytes of an image sent as a base64 data URL (`data:image/png;base64,...`), as chat
    content parts and video image references carry it. Remote URLs are refused (the server
    fetches nothing); every refusal names `field`."""
    if url.startswith(("http://", "https://", "file:")):
        raise InvalidRequest(field, f"{field}: images must be sent as data URLs "
                             "(data:image/png;base64,...); this server fetches no URLs")
    header = _IMAGE_DATA_URL.match(url[:MAX_DATA_URL_HEADER_CHARS])
    if header is None:
        raise InvalidRequest(field, f"{field}: an image must be a base64 data URL "
                             "(data:image/png;base64,...)")
    try:
        return base64.b64decode(url[header.end():], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, f"{field}: the image's data URL is not valid base64") from None


# -- the client leaving ---------------------------------------------------------------------------

#: The status a request answers when its client left before the answer (nginx's convention).
CLIENT_GONE_STATUS = HTTP_STATUS[grpc.StatusCode.CANCELLED]


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


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


# A request's `lora` on REST: a JSON array of {"name", "scale"} objects, or (multipart) one
# field holding that array as text; checked later against the DiT's facts (mesh/stages.py).

def parse_lora(value: object) -> tuple[LoraChoice, ...]:
    """A JSON `lora` value: an array of {"name": str, "scale": number (default 1)}; absent or
    null = none."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise refuse_lora('must be an array of {"name", "scale"} objects')
    choices = []
    for item in value:
        if not isinstance(item, dict) or set(item) - {"name", "scale"}:
            raise refuse_lora('each adapter is an object with "name" and optional "scale"')
        name, scale = item.get("name"), item.get("scale", DEFAULT_SCALE)
        if not isinstance(name, str) or not name:
            raise refuse_lora("each adapter needs a non-empty string name")
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise refuse_lora(f"scale of {name!r} must be a number")
        choices.append(LoraChoice(name, float(scale)))
    return tuple(choices)


def parse_lora_text(text: str | None) -> tuple[LoraChoice, ...]:
    """A multipart form's `lora` field: the same JSON array as one string."""
    if text is None or not text.strip():
        return ()
    try:
        value = json.loads(text)
    except ValueError:
        raise refuse_lora('must be a JSON array of {"name", "scale"} objects') from None
    return parse_lora(value)
