"""The LoRA admin bodies, in vLLM's shape: POST /v1/load_lora_adapter takes `lora_name` and
`lora_path`, POST /v1/unload_lora_adapter takes `lora_name`; both take `model` as well, the
recipe whose DiT changes (absent: every recipe whose DiT loads adapters at run time). The DiT
checks name and path (its `lora_dir` bounds the path); a field of another type, or one this
route does not read, is a 400 naming it. The gRPC API's LoadLora/UnloadLora fields are checked
by the same rules (`load_update`, `unload_update`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.wire.requests import JsonFields

LOAD_FIELDS = frozenset({"lora_name", "lora_path", "model"})
UNLOAD_FIELDS = frozenset({"lora_name", "model"})


@dataclass(frozen=True)
class LoraUpdate:
    """A load (with its path) or an unload (path empty) of one adapter."""

    lora_name: str
    lora_path: str = ""
    model: str | None = None  # None: every recipe whose DiT takes runtime updates


def _parse(body: Mapping[str, object], known: frozenset[str]) -> LoraUpdate:
    """Every field read first (then checked), so a refusal names the first bad one."""
    fields = JsonFields(body)
    values = {name: fields.string(name) for name in sorted(known)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidRequest(unknown[0], f"{unknown[0]}: not a field of this route; it takes "
                                         f"{sorted(known)}")
    return _checked(values, known)


def _checked(values: Mapping[str, str | None], known: frozenset[str]) -> LoraUpdate:
    """The update; every field but `model` is required."""
    for name in sorted(known - {"model"}):
        if not values.get(name):
            raise InvalidRequest(name, f"{name} is required")
    return LoraUpdate(values.get("lora_name") or "", values.get("lora_path") or "",
                      values.get("model") or None)


def load_request(body: Mapping[str, object]) -> LoraUpdate:
    return _parse(body, LOAD_FIELDS)


def unload_request(body: Mapping[str, object]) -> LoraUpdate:
    return _parse(body, UNLOAD_FIELDS)


def load_update(lora_name: str, lora_path: str, model: str) -> LoraUpdate:
    """A load from the gRPC API's fields (empty = not given), checked as the REST body."""
    return _checked({"lora_name": lora_name, "lora_path": lora_path, "model": model},
                    LOAD_FIELDS)


def unload_update(lora_name: str, model: str) -> LoraUpdate:
    """An unload from the gRPC API's fields (empty = not given), checked as the REST body."""
    return _checked({"lora_name": lora_name, "model": model}, UNLOAD_FIELDS)
