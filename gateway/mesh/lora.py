"""A request's LoRA adapters as the DiT takes them (common.LoraAdapter), and what the recipe's
DiT publishes about them (DescribeDit lora_names, max_loras_per_request, max_lora_scale): every
refusal is a 400 naming `lora`, before any stage runs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2

FIELD = "lora"
#: What a request names when it gives no scale (diffusers' set_adapters default).
DEFAULT_SCALE = 1.0


@dataclass(frozen=True)
class LoraChoice:
    """One adapter a request runs under, at its scale."""

    name: str
    scale: float = DEFAULT_SCALE


def refuse_lora(message: str) -> InvalidRequest:
    return InvalidRequest(FIELD, f"lora: {message}")


def lora_from_proto(uses: Iterable[common_pb2.LoraAdapter]) -> tuple[LoraChoice, ...]:
    return tuple(
        LoraChoice(use.name, use.scale if use.HasField("scale") else DEFAULT_SCALE) for use in uses
    )


def lora_to_proto(choices: Sequence[LoraChoice]) -> list[common_pb2.LoraAdapter]:
    return [common_pb2.LoraAdapter(name=choice.name, scale=choice.scale) for choice in choices]


@dataclass(frozen=True)
class LoraFacts:
    """What the recipe's DiT publishes about its adapters (none by default)."""

    names: frozenset[str] = frozenset()
    max_per_request: int = 0
    max_scale: float = 0.0

    def check(self, choices: Sequence[LoraChoice]) -> None:
        """Known names, each once, at most max_per_request, |scale| within max_scale."""
        if not choices:
            return
        if not self.names:
            raise refuse_lora("this model serves no LoRA adapters")
        if len(choices) > self.max_per_request:
            raise refuse_lora(
                f"at most {self.max_per_request} adapters per request, got {len(choices)}"
            )
        seen: set[str] = set()
        for choice in choices:
            if choice.name not in self.names:
                raise refuse_lora(
                    f"unknown adapter {choice.name!r}; this model serves {sorted(self.names)}"
                )
            if choice.name in seen:
                raise refuse_lora(f"adapter {choice.name!r} named twice")
            seen.add(choice.name)
            if not (math.isfinite(choice.scale) and abs(choice.scale) <= self.max_scale):
                raise refuse_lora(
                    f"scale of {choice.name!r} must be within ±{self.max_scale:g}, "
                    f"got {choice.scale}"
                )

    @classmethod
    def published(cls, dit: dit_service_pb2.DescribeDitResponse) -> LoraFacts:
        return cls(frozenset(dit.lora_names), dit.max_loras_per_request, dit.max_lora_scale)


#: A DiT that serves no adapters (and what a request's facts default to).
NO_LORAS = LoraFacts()
