"""The OpenAPI document (gateway/openapi.py) documents the multipart forms with exactly the
fields their routes read: a field the route takes but the document omits is never fuzzed, and
one the document names but the route refuses would be a 400 for a client that trusts it."""

from __future__ import annotations

from typing import Any

from stagemesh.gateway.http.openapi import openapi_document
from stagemesh.gateway.images.edit_forms import EDIT_FIELDS
from stagemesh.gateway.videos.routes import FORM_FIELDS


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
