"""Forms, shared by the routes that take them (image edits, videos): multipart/form-data with
field, file and count limits, or application/x-www-form-urlencoded (what `curl -d` and
FastAPI-based servers send; text fields only), both read into one Form."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.wire.requests import (
    MAX_BODY_BYTES,
    capped_stream,
    check_declared_length,
    off_loop,
    read_body,
)

#: Parts of each kind one form may hold, and the default size of a text field (a route names
#: the fields that may be larger, e.g. a data URL) and of a file.
MAX_FORM_FIELDS = 64
MAX_FORM_FILES = 16
MAX_FORM_FIELD_BYTES = 64 * 1024
MAX_FORM_FILE_BYTES = 20 * 1024 * 1024
FORM_CONTENT_TYPE = "multipart/form-data"
URLENCODED_CONTENT_TYPE = "application/x-www-form-urlencoded"
#: The escapes the HTML form encoding writes in a part's name (`"` as %22, control characters
#: as %0D and the like: browsers, httpx, urllib3); undone, so that a 400 names a field as the
#: client named it.
_NAME_ESCAPE = re.compile("%(22|[01][0-9A-Fa-f])")


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
                    max_files: int = MAX_FORM_FILES, urlencoded: bool = False) -> Form:
    """The body as a multipart/form-data form, bounded every way a client could make it large:
    the whole body by MAX_BODY_BYTES (a 413, before reading when Content-Length says so), the
    parts by MAX_FORM_FIELDS text fields and `max_files` files, each text field by
    MAX_FORM_FIELD_BYTES (or its entry in `large_fields`, e.g. a data URL), each file by
    `max_file_bytes`. Files spool to disk past 1 MiB while the body arrives (Starlette's
    parser, on python-multipart), so memory holds at most what the checks let through.
    Every refusal but the 413 is a 400 naming the field (or `body`). With `urlencoded`, an
    application/x-www-form-urlencoded body is read too, under the same field limits."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if urlencoded and media_type == URLENCODED_CONTENT_TYPE:
        return await _read_urlencoded(request, large_fields or {})
    if media_type != FORM_CONTENT_TYPE:
        accepted = f"{FORM_CONTENT_TYPE} or {URLENCODED_CONTENT_TYPE}" if urlencoded \
            else FORM_CONTENT_TYPE
        raise InvalidRequest("body", f"the request body must be {accepted}, got "
                             f"{content_type.split(';', 1)[0][:80]!r}")
    check_declared_length(request, MAX_BODY_BYTES)
    parser = MultiPartParser(request.headers, capped_stream(request, MAX_BODY_BYTES),
                             max_files=max_files,
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




async def _read_urlencoded(request: Request, large_fields: Mapping[str, int]) -> Form:
    """An urlencoded body as a Form of text fields, checked like a multipart form's."""
    raw = await read_body(request, MAX_BODY_BYTES)
    try:
        pairs = await off_loop(len(raw), lambda: parse_qsl(
            raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False,
            max_num_fields=MAX_FORM_FIELDS))
    except UnicodeDecodeError:
        raise InvalidRequest("body", "the form is not UTF-8") from None
    except ValueError as error:  # more than MAX_FORM_FIELDS fields
        raise InvalidRequest("body", f"malformed form: {error}") from None
    return await _checked_form(list(pairs), large_fields, MAX_FORM_FILE_BYTES)
