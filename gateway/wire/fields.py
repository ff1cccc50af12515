"""OpenAI request bodies -> the gateway's typed request records, read once.

Only the JSON shape is checked here (types, formats, which values a field may take); the limits
are checked against what the stages publish when the request is prepared (image_params.py,
speech_params.py). Every refusal names its field.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.edit_protocol import MAX_DATA_URL_HEADER_CHARS
from stagemesh.gateway.images.protocol import EXECUTION_MODES, ImageRequest, parse_size
from stagemesh.gateway.speech.protocol import SpeechRequest
from stagemesh.gateway.wire.bodies import JsonObject
from stagemesh.shared.proto.v1 import common_pb2

DATA_URL_PREFIX = "data:"
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


def execution_mode(value: str | None) -> common_pb2.ExecutionMode.ValueType:
    """An `execution_mode` field's text (None = the DiT's default) -> the proto's enum."""
    if value is None:
        return common_pb2.EXECUTION_MODE_UNSPECIFIED
    if value not in EXECUTION_MODES:
        raise InvalidRequest("execution_mode",
                             f"execution_mode must be one of {sorted(EXECUTION_MODES)}")
    return EXECUTION_MODES[value]


def image_request(body: Mapping[str, object]) -> ImageRequest:
    """POST /v1/images/generations: OpenAI's fields plus stagemesh's extensions."""
    fields = JsonFields(body)
    size = fields.string("size")
    width, height = (parse_size(size) if size is not None
                     else (fields.integer("width"), fields.integer("height")))
    if body.get("response_format", "b64_json") != "b64_json":
        raise InvalidRequest("response_format", "only response_format 'b64_json' is supported")
    scale_field = "true_cfg_scale" if "true_cfg_scale" in body else "guidance_scale"
    return ImageRequest(
        prompt=fields.string("prompt") or "", model=fields.string("model") or "",
        negative_prompt=fields.string("negative_prompt"), n=fields.integer("n"),
        width=width, height=height,
        num_inference_steps=fields.integer("num_inference_steps"),
        true_cfg_scale=_cfg_scale(fields, scale_field), seed=fields.integer("seed"),
        execution_mode=execution_mode(fields.string("execution_mode")),
        priority=fields.integer("priority"))


def _cfg_scale(fields: JsonFields, name: str) -> float | None:
    """true_cfg_scale (alias guidance_scale); a refusal names true_cfg_scale either way."""
    try:
        return fields.number(name)
    except InvalidRequest:
        raise InvalidRequest("true_cfg_scale", "true_cfg_scale must be a number") from None


def chat_image_request(body: Mapping[str, object]) -> ImageRequest:
    """POST /v1/chat/completions with image output: the prompt is the last user message's
    text; width/height (in extra_body) win over size."""
    fields = {key: value for key, value in body.items() if key != "prompt"}
    if "height" in body or "width" in body:
        fields.pop("size", None)
    prompt = last_user_text(body.get("messages"))
    if not prompt.strip():  # the client sent messages, not a prompt: name those
        raise InvalidRequest("messages", "the last user message must have text")
    fields["prompt"] = prompt
    return image_request(fields)


def last_user_text(messages: object) -> str:
    """The prompt of a chat request: the text of the last user message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "messages must be a non-empty list")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                texts = [str(p.get("text", "")) for p in content
                         if isinstance(p, dict) and p.get("type") == "text"]
                return " ".join(t for t in texts if t)
    raise InvalidRequest("messages", "messages must contain a user message with text")


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


def speech_request(body: Mapping[str, object]) -> tuple[SpeechRequest, bool]:
    """POST /v1/audio/speech: OpenAI's fields plus the seed's extensions -> (request, stream)."""
    fields = JsonFields(body)
    stream_format = fields.string("stream_format")
    if stream_format not in (None, "audio"):
        raise InvalidRequest("stream_format", "only stream_format 'audio' is supported")
    ref_audio = fields.string("ref_audio")
    request = SpeechRequest(
        input=fields.string("input") or "", model=fields.string("model") or "",
        voice=fields.string("voice"), response_format=fields.string("response_format"),
        speed=fields.number("speed"), task_type=fields.string("task_type"),
        language=fields.string("language"), instructions=fields.string("instructions"),
        ref_audio=None if ref_audio is None else ref_audio_bytes(ref_audio),
        ref_text=fields.string("ref_text"), seed=fields.integer("seed"),
        max_new_tokens=fields.integer("max_new_tokens"),
        temperature=fields.number("temperature"), top_p=fields.number("top_p"),
        top_k=fields.integer("top_k"))
    return request, bool(fields.boolean("stream"))
