"""HTTP I/O shared by every REST route: bodies (with a size cap), multipart forms (with field,
file and count limits), disconnects, SSE and NDJSON framing, error responses, and the request
id and timeout a transport hands to the core."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
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
#: Multipart forms: parts of each kind one form may hold, and the default size of a text field
#: (a route names the fields that may be larger, e.g. a data URL) and of a file.
MAX_FORM_FIELDS = 64
MAX_FORM_FILES = 16
MAX_FORM_FIELD_BYTES = 64 * 1024
MAX_FORM_FILE_BYTES = 20 * 1024 * 1024
FORM_CONTENT_TYPE = "multipart/form-data"
#: The escapes the HTML form encoding writes in a part's name (`"` as %22, control characters
#: as %0D and the like: browsers, httpx, urllib3); undone, so that a 400 names a field as the
#: client named it.
_NAME_ESCAPE = re.compile("%(22|[01][0-9A-Fa-f])")
#: The last SSE event of every stream.
SSE_DONE = b"data: [DONE]\n\n"

JsonObject = dict[str, object]


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def read_body(request: Request) -> bytes:
    """The whole body, refused with a 413 (naming `body`) before it is read when its
    Content-Length is over MAX_BODY_BYTES, or as soon as the bytes read pass it."""
    _check_declared_length(request)
    return b"".join([chunk async for chunk in _capped_stream(request)])


def _check_declared_length(request: Request) -> None:
    """A 413 before any byte is read when Content-Length is over MAX_BODY_BYTES."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > len(str(MAX_BODY_BYTES))
                                                      or int(declared) > MAX_BODY_BYTES):
        raise BodyTooLarge(MAX_BODY_BYTES)


async def _capped_stream(request: Request) -> AsyncGenerator[bytes, None]:
    """The body's chunks, raising BodyTooLarge as soon as they pass MAX_BODY_BYTES."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(MAX_BODY_BYTES)
        yield chunk


@dataclass(frozen=True)
class FormFile:
    """An uploaded file of a multipart form, read whole (it was size-checked first)."""

    filename: str
    content_type: str
    data: bytes


@dataclass(frozen=True)
class Form:
    """A multipart form: text fields and files by name, in the order sent."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, list[FormFile]] = field(default_factory=dict)

    def names(self) -> set[str]:
        return set(self.fields) | set(self.files)

    def text(self, name: str) -> str | None:
        """The one text value of `name` (None when absent); a repeated field or a file sent
        under a text field's name is a 400 naming it."""
        if name in self.files:
            raise InvalidRequest(name, f"{name} must be a text field, not a file")
        values = self.fields.get(name)
        if not values:
            return None
        if len(values) > 1:
            raise InvalidRequest(name, f"{name} was given {len(values)} times; give it once")
        return values[0]

    def file_list(self, name: str) -> list[FormFile]:
        """Every file sent as `name` (also as `name[]`, as some clients send repeated files);
        text sent under a file field's name is a 400 naming it."""
        if name in self.fields or f"{name}[]" in self.fields:
            raise InvalidRequest(name, f"{name} must be a file upload (multipart file part)")
        return [*self.files.get(name, []), *self.files.get(f"{name}[]", [])]

    def refuse_unknown(self, known: set[str]) -> None:
        """A 400 naming the first field the route does not take."""
        for name in sorted(self.names()):
            if name not in known and name.removesuffix("[]") not in known:
                raise InvalidRequest(name, f"unknown field {name!r}")


def parse_integer(name: str, text: str) -> int:
    """A form or query value as an integer; else a 400 naming `name`."""
    try:
        return int(text.strip())
    except ValueError:
        raise InvalidRequest(name, f"{name} must be an integer, got {text[:40]!r}") from None


class FormFields:
    """Typed reads of a form's text fields: None when absent (and, with `blank_is_absent`,
    when blank); a value that does not parse is a 400 naming the field."""

    def __init__(self, form: Form, *, blank_is_absent: bool = False) -> None:
        self.form = form
        self.blank_is_absent = blank_is_absent

    def string(self, name: str) -> str | None:
        return self.form.text(name)

    def _given(self, name: str) -> str | None:
        text = self.form.text(name)
        return None if self.blank_is_absent and text is not None and not text.strip() else text

    def integer(self, name: str) -> int | None:
        text = self._given(name)
        return None if text is None else parse_integer(name, text)

    def number(self, name: str) -> float | None:
        text = self._given(name)
        if text is None:
            return None
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise InvalidRequest(name, f"{name} must be a number, got {text[:40]!r}")
        return value

    def boolean(self, name: str) -> bool:
        text = self.form.text(name)
        if text is None:
            return False
        if text.strip().lower() not in ("true", "false"):
            raise InvalidRequest(name, f"{name} must be true or false, got {text[:40]!r}")
        return text.strip().lower() == "true"


async def read_form(request: Request, *, large_fields: Mapping[str, int] | None = None,
                    max_file_bytes: int = MAX_FORM_FILE_BYTES,
                    max_files: int = MAX_FORM_FILES) -> Form:
    """The body as a multipart/form-data form, bounded every way a client could make it large:
    the whole body by MAX_BODY_BYTES (a 413, before reading when Content-Length says so), the
    parts by MAX_FORM_FIELDS text fields and `max_files` files, each text field by
    MAX_FORM_FIELD_BYTES (or its entry in `large_fields`, e.g. a data URL), each file by
    `max_file_bytes`. Files spool to disk past 1 MiB while the body arrives (Starlette's
    parser, on python-multipart), so memory holds at most what the checks let through.
    Every refusal but the 413 is a 400 naming the field (or `body`)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != FORM_CONTENT_TYPE:
        raise InvalidRequest("body", f"the request body must be {FORM_CONTENT_TYPE}, got "
                             f"{content_type.split(';', 1)[0][:80]!r}")
    _check_declared_length(request)
    parser = MultiPartParser(request.headers, _capped_stream(request), max_files=max_files,
                             max_fields=MAX_FORM_FIELDS, max_part_size=MAX_BODY_BYTES)
    try:
        parsed = await parser.parse()
    except MultiPartException as error:
        raise InvalidRequest("body", f"malformed multipart form: {error.message}") from None
    try:
        return await _checked_form(parsed.multi_items(), large_fields or {}, max_file_bytes)
    finally:
        await parsed.close()


async def _checked_form(items: list[tuple[str, str | UploadFile]],
                        large_fields: Mapping[str, int], max_file_bytes: int) -> Form:
    form = Form()
    for wire_name, value in items:
        name = _NAME_ESCAPE.sub(lambda escape: chr(int(escape[1], 16)), wire_name)
        if isinstance(value, str):
            limit = large_fields.get(name, MAX_FORM_FIELD_BYTES)
            if len(value.encode("utf-8", "replace")) > limit:
                raise InvalidRequest(name, f"{name} is larger than {limit} bytes")
            form.fields.setdefault(name, []).append(value)
            continue
        if value.size is not None and value.size > max_file_bytes:
            raise InvalidRequest(name, f"file {name} is larger than {max_file_bytes} bytes")
        data = await value.read()
        form.files.setdefault(name, []).append(FormFile(
            filename=value.filename or "", content_type=value.content_type or "", data=data))
    return form


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
