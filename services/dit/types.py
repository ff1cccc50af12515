"""What every DiT adapter of the stage shares (Qwen-Image, Wan): its result and its host device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Where results are handed over: the servicer serializes them from host memory.
CPU = torch.device("cpu")


@dataclass(frozen=True)
class DenoisedLatents:
    """The DiT stage's result: packed latents [1, tokens, z_dim * 4], the pixel size they make."""

    latents: torch.Tensor
    height: int
    width: int
    num_frames: int = 0  # video frames the latents decode to; 0 for an image
