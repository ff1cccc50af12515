"""Typed reads of JSON request bodies, shared by every resource's protocol: fields by type,
OpenAI's `extra_body`, and base64 data URLs (images, audio). Every refusal names its field.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.wire.bodies import JsonObject

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
    one pass; callers decode megabytes off the event loop (http_io.off_loop).
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
