"""The OpenAPI document (gateway/http/openapi.py) documents the JSON bodies and multipart forms
with exactly the fields their routes read: a field the route takes but the document omits is
never fuzzed, and one the document names but the route refuses would be a 400 for a client
that trusts it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from stagemesh.gateway.chat.protocol import (
    ROLES,
    UNSUPPORTED_FIELDS,
    chat_request,
)
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.http.openapi import openapi_document
from stagemesh.gateway.images.edit_forms import EDIT_FIELDS
from stagemesh.gateway.images.protocol import image_request
from stagemesh.gateway.loras.protocol import load_request, unload_request
from stagemesh.gateway.speech.protocol import speech_request
from stagemesh.gateway.videos.protocol import FORM_FIELDS


def form_schema(path: str) -> dict[str, Any]:
    operation: Any = openapi_document()["paths"]
    schema: dict[str, Any] = operation[path]["post"]["requestBody"]["content"][
        "multipart/form-data"]["schema"]
    return schema


def test_the_edit_form_documents_every_field_the_route_reads() -> None:
    form = form_schema("/v1/images/edits")
    assert set(form["properties"]) == EDIT_FIELDS
    assert set(form["required"]) == {"image", "prompt"}
    image = form["properties"]["image"]
    assert image["type"] == "array" and image["items"]["contentEncoding"] == "binary"
    assert form["properties"]["n"] == {"type": "integer"}
    assert form["properties"]["prompt"] == {"type": "string"}


def test_the_video_form_documents_every_field_the_route_reads() -> None:
    for path in ("/v1/videos", "/v1/videos/sync"):
        assert set(form_schema(path)["properties"]) == FORM_FIELDS, path


# -- the JSON bodies: documented == parsed ---------------------------------------------------


class Recording(dict[str, Any]):
    """A JSON object that records every top-level field a parser looks at."""

    def __init__(self, body: dict[str, Any], seen: set[str]) -> None:
        super().__init__(body)
        self.seen = seen

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)

    def __getitem__(self, key: str) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)


def parsed_fields(parse: Callable[[Mapping[str, object]], object],
                  body: dict[str, Any]) -> set[str]:
    seen: set[str] = set()
    with contextlib.suppress(InvalidRequest):
        parse(Recording(body, seen))
    return seen


def json_schema(path: str) -> dict[str, Any]:
    paths: Any = openapi_document()["paths"]
    schema: dict[str, Any] = paths[path]["post"]["requestBody"]["content"]["application/json"][
        "schema"]
    return schema


#: The OpenAI JSON routes: the parsers of their bodies, the fields each route reads itself
#: around its parser (`timeout`: the request's deadline; `stream`), and the fields a parser
#: reads only to refuse them (chat: OpenAI fields stagemesh cannot honour; the image prompt,
#: which chat takes from the messages).
JSON_ROUTES = [
    ("/v1/images/generations", [image_request], {"stream", "timeout"}, set()),
    ("/v1/audio/speech", [speech_request], {"timeout"}, set()),
    ("/v1/chat/completions", [chat_request, image_request], {"timeout"},
     {*UNSUPPORTED_FIELDS, "prompt"}),
    ("/v1/load_lora_adapter", [load_request], set(), set()),
    ("/v1/unload_lora_adapter", [unload_request], set(), set()),
]


@pytest.mark.parametrize(("path", "parsers", "route_fields", "not_documented"), JSON_ROUTES)
def test_every_json_field_a_route_parses_is_documented_and_no_other(
    path: str, parsers: list[Callable[[Mapping[str, object]], object]], route_fields: set[str],
    not_documented: set[str],
) -> None:
    body = {"prompt": "p", "input": "hi", "messages": [{"role": "user", "content": "hi"}]}
    parsed = set().union(*(parsed_fields(parse, body) for parse in parsers)) | route_fields
    documented = set(json_schema(path)["properties"])
    assert documented == parsed - not_documented


def test_the_video_json_body_documents_the_form_fields() -> None:
    for path in ("/v1/videos", "/v1/videos/sync"):
        assert set(json_schema(path)["properties"]) == FORM_FIELDS - {"input_reference"}


def test_the_chat_message_schema_takes_every_role_and_content_part_the_parsers_take() -> None:
    message = json_schema("/v1/chat/completions")["properties"]["messages"]["items"]
    assert set(message["properties"]["role"]["enum"]) == set(ROLES)
    parts = message["properties"]["content"]["oneOf"][1]["items"]
    assert set(parts["properties"]["type"]["enum"]) == {"text", "image_url"}
