"""What every VAE adapter of the stage accepts (Qwen-Image decode, image encode, Wan video)."""

from __future__ import annotations

from dataclasses import dataclass

from stagemesh.shared.engine.adapter import InvalidInputError


@dataclass(frozen=True)
class VaeLimits:
    """What the stage accepts (its Describe facts)."""

    size_multiple: int  # height and width are multiples of this (the latent factor)
    max_side: int  # pixels
    max_frames: int = 0  # video frames one request may decode or encode; 0: images only
    frame_multiple: int = 1  # a video's num_frames is 1 + a multiple of this


def check_size(limits: VaeLimits, height: int, width: int) -> None:
    """height and width within the stage's limits, or InvalidInputError naming `size`."""
    factor, max_side = limits.size_multiple, limits.max_side
    if not all(0 < side <= max_side and side % factor == 0 for side in (height, width)):
        raise InvalidInputError(
            "size",
            f"height and width must be positive multiples of {factor} up to {max_side}, "
            f"got {height}x{width}",
        )
