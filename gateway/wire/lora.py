"""A request's `lora` on REST: a JSON array of {"name", "scale"} objects, or (multipart) one
field holding that array as text. Checked later against the DiT's facts (mesh/lora.py)."""

from __future__ import annotations

import json

from stagemesh.gateway.mesh.lora import DEFAULT_SCALE, LoraChoice, refuse_lora


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
