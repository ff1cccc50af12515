"""The DiT stage's input checks that every model's adapter shares (one wording, one rule).

Each raises `InvalidInputError` naming the field, checked against the stage's `DitLimits` (its
published Describe facts), so a client reads the same limit in the error as in Describe.
"""

from __future__ import annotations

import math

import torch

from stagemesh.services.dit.limits import DitLimits
from stagemesh.shared.engine.adapter import InvalidInputError
from stagemesh.shared.limits import MAX_SEED


def check_size(
    limits: DitLimits, height: int, width: int, *, field: str = "size", what: str = ""
) -> None:
    """The output size: positive multiples of size_multiple, <= max_side, <= max_pixels; or
    (field, what: the message's prefix) the size an image's latents stand for, bounded alike."""
    factor, max_side = limits.size_multiple, limits.max_side
    for side in (height, width):
        if not (0 < side <= max_side and side % factor == 0):
            raise InvalidInputError(
                field,
                f"{what}height and width must be positive multiples of {factor} up to "
                f"{max_side}, got {height}x{width}",
            )
    if height * width > limits.max_pixels:
        raise InvalidInputError(
            field, f"{what}{height}x{width} is more than {limits.max_pixels} pixels"
        )


def check_steps(limits: DitLimits, steps: int) -> None:
    if not limits.min_steps <= steps <= limits.max_steps:
        raise InvalidInputError(
            "num_inference_steps",
            f"num_inference_steps must be in [{limits.min_steps}, {limits.max_steps}], got {steps}",
        )


def check_scale(name: str, value: float, limit: float) -> None:
    """A guidance scale: finite, in [0, limit]."""
    if not (math.isfinite(value) and 0.0 <= value <= limit):
        raise InvalidInputError(name, f"{name} must be in [0, {limit}], got {value}")


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise InvalidInputError("seed", f"seed must be in [0, {MAX_SEED}], got {seed}")


def check_finite(field: str, name: str, tensor: torch.Tensor) -> None:
    """A tensor another stage sent: floating-point, no NaN or infinity."""
    if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
        raise InvalidInputError(field, f"{name} must be finite floating-point values")


def check_embeds(
    name: str, embeds: torch.Tensor, mask: torch.Tensor | None, dim: int, limit: int
) -> None:
    """Prompt embeddings `name`: [1, 1..limit tokens, dim], finite, and a mask of their
    [1, tokens] if any (field `embeddings`)."""
    shape = tuple(embeds.shape)
    if embeds.ndim != 3 or shape[0] != 1 or shape[2] != dim or not 1 <= shape[1] <= limit:
        raise InvalidInputError(
            "embeddings", f"{name} must be [1, 1..{limit}, {dim}], got {list(shape)}"
        )
    check_finite("embeddings", name, embeds)
    if mask is not None and tuple(mask.shape) != shape[:2]:
        raise InvalidInputError(
            "embeddings", f"{name} mask must be {list(shape[:2])}, got {list(mask.shape)}"
        )
