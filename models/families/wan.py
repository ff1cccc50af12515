"""The Wan family (diffusers `WanPipeline` / `WanImageToVideoPipeline` folders): what its stages
share.

The Tokenizer, DiT and VAE stages of a Wan mesh each redo one part of the stock pipelines; the
rules that more than one of them needs (frame counts, latent geometry, the latent normalization)
live here, read from the folder's configs the way the pipelines read them, so that no stage
imports another and none re-derives a rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

#: The pipelines' `max_sequence_length` default: UMT5 prompt embeddings are padded (with zeros)
#: or truncated to exactly this many tokens.
PROMPT_MAX_TOKENS = 512
#: The two-transformer (Wan 2.2 A14B) folders name the low-noise expert so.
SECOND_TRANSFORMER = "transformer_2"


@dataclass(frozen=True)
class WanGeometry:
    """The sizes a Wan folder's VAE and transformer fix, as the pipelines derive them."""

    temporal_factor: int  # vae.config.scale_factor_temporal: frames per latent frame (4)
    spatial_factor: int  # vae.config.scale_factor_spatial: pixels per latent pixel (8)
    z_dim: int  # latent channels (16)
    patch: tuple[int, int, int]  # transformer.config.patch_size (frames, height, width)
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> WanGeometry:
        """Read `vae/config.json` and the (first present) transformer's `config.json`."""
        root = Path(model_dir)
        vae = json.loads((root / "vae" / "config.json").read_text())
        transformer_dir = root / "transformer"
        if not transformer_dir.is_dir():
            transformer_dir = root / SECOND_TRANSFORMER
        transformer = json.loads((transformer_dir / "config.json").read_text())
        patch = tuple(int(p) for p in transformer["patch_size"])
        if len(patch) != 3:
            raise ValueError(f"{transformer_dir}/config.json: patch_size must have 3 entries")
        return cls(
            temporal_factor=int(vae["scale_factor_temporal"]),
            spatial_factor=int(vae["scale_factor_spatial"]),
            z_dim=int(vae["z_dim"]),
            patch=(patch[0], patch[1], patch[2]),
            latents_mean=tuple(float(v) for v in vae["latents_mean"]),
            latents_std=tuple(float(v) for v in vae["latents_std"]),
        )

    @property
    def frame_multiple(self) -> int:
        """`num_frames - 1` must be a multiple of this (the 4k+1 rule)."""
        return self.temporal_factor

    @property
    def size_multiple(self) -> tuple[int, int]:
        """What video height and width must be multiples of: VAE factor x patch."""
        return self.spatial_factor * self.patch[1], self.spatial_factor * self.patch[2]

    def round_num_frames(self, num_frames: int) -> int:
        """The frame count the pipelines actually generate for a requested `num_frames`."""
        return round_num_frames(num_frames, self.temporal_factor)

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames for a (valid) frame count: the first frame alone, then one per group."""
        return (num_frames - 1) // self.temporal_factor + 1

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """[C, F, h, w] of the latents for a valid frame count and size (batch excluded)."""
        return (self.z_dim, self.latent_frames(num_frames),
                height // self.spatial_factor, width // self.spatial_factor)

    def floor_size(self, height: int, width: int) -> tuple[int, int]:
        """The pipelines floor height and width to `size_multiple` (with a warning)."""
        h_multiple, w_multiple = self.size_multiple
        return height // h_multiple * h_multiple, width // w_multiple * w_multiple

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE posterior -> the latents the transformer sees (the I2V condition); the exact
        arithmetic of `WanImageToVideoPipeline.prepare_latents`: (x - mean) * (1 / std)."""
        mean, inv_std = self._stats(latents)
        return (latents - mean) * inv_std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Denoised latents -> what `vae.decode` takes; the pipelines' exact arithmetic:
        x / (1 / std) + mean."""
        mean, inv_std = self._stats(latents)
        return latents / inv_std + mean

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.z_dim, 1, 1, 1)
        mean = torch.tensor(self.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = (1.0 / torch.tensor(self.latents_std).view(shape)).to(latents.device,
                                                                         latents.dtype)
        return mean, inv_std


def round_num_frames(num_frames: int, temporal_factor: int) -> int:
    """The pipelines' rule: a count that is not 4k+1 becomes (n // 4) * 4 + 1 (so 8 -> 9,
    10 -> 9), and at least 1."""
    if num_frames % temporal_factor != 1:
        num_frames = num_frames // temporal_factor * temporal_factor + 1
    return max(num_frames, 1)


def i2v_condition_mask(num_frames: int, temporal_factor: int, latent_height: int,
                       latent_width: int) -> torch.Tensor:
    """The first-frame mask `WanImageToVideoPipeline` puts before the condition latents:
    [1, temporal_factor, latent_frames, h, w], ones where the frame is given (the first)."""
    mask = torch.ones(1, 1, num_frames, latent_height, latent_width)
    mask[:, :, 1:] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal_factor)
    mask = torch.concat([first, mask[:, :, 1:]], dim=2)
    mask = mask.view(1, -1, temporal_factor, latent_height, latent_width)
    return mask.transpose(1, 2)


def boundary_timestep(boundary_ratio: float | None, num_train_timesteps: int) -> float | None:
    """Timesteps at or above this go to `transformer`, below it to `transformer_2`."""
    return None if boundary_ratio is None else boundary_ratio * num_train_timesteps


def read_boundary_ratio(model_dir: str | Path) -> float | None:
    """The folder's `boundary_ratio` (model_index.json); None for one-transformer folders."""
    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    ratio = index.get("boundary_ratio")
    return None if ratio is None else float(ratio)
