"""Fits a model folder's latent-to-RGB preview projection (`vae/preview.json`) from its VAE.

The DiT stage's step previews (services/dit/preview.py) turn latents into pixels with a linear
map that belongs to the VAE (unless its own small decoder paints them: `preview_decode`). It is
fitted once per folder: encode known pictures with the VAE, normalize the latents as the DiT
holds them, and solve least squares for each latent pixel's block of pixels. Pictures like the
model's own make the best fit (tiny-shapes: its renders, at training); `stagemesh model prepare`
fits a large-VAE folder that has none on generic pictures (`prepare_projection`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from stagemesh.services.dit.preview import PROJECTION_FILE, Projection, fit_projection
from stagemesh.services.dit.preview_decode import (
    decoder_paints,
    folder_vae_class,
    spatial_factor,
    vae_config,
)
from stagemesh.services.vae.kinds import latent_stats

logger = logging.getLogger(__name__)

#: Pictures encoded at once while fitting (bounds the encoder's memory).
ENCODE_CHUNK = 16
#: Generic pictures a prepare fits on, and their latent grid's side.
GENERIC_PICTURES = 64
GENERIC_LATENT_SIDE = 12


@torch.inference_mode()
def fit_folder_projection(model_dir: str | Path, pictures: npt.NDArray[np.uint8], *,
                          write: bool = True) -> Projection:
    """The projection for the folder's VAE (Qwen-Image's or Wan's), fitted on uint8 RGB
    `pictures` [n, height, width, 3]; written to `vae/preview.json` as well unless not
    `write`."""
    vae_class = folder_vae_class(model_dir)
    if vae_class is None:
        raise ValueError(f"{model_dir}: no Qwen-Image or Wan VAE to fit a preview projection for")
    vae = vae_class.from_pretrained(model_dir, subfolder="vae", local_files_only=True,
                                    dtype=torch.float32).eval()
    mean, std = latent_stats(vae)
    pixels = torch.from_numpy(pictures).permute(0, 3, 1, 2).float() / 255.0  # [n, 3, H, W]
    latents = []
    for chunk in torch.split(pixels, ENCODE_CHUNK):
        encoded = vae.encode((chunk * 2 - 1)[:, :, None]).latent_dist.mode()
        latents.append(((encoded - mean) / std)[:, :, 0])
    grid = torch.cat(latents)
    projection = fit_projection(grid, pixels, factor=pixels.shape[-1] // grid.shape[-1])
    if write:
        path = projection.save(Path(model_dir))
        logger.info("fitted %s on %d pictures (factor %d)", path, len(pictures),
                    projection.factor)
    return projection


def generic_pictures(count: int, side: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """uint8 [count, side, side, 3]: smooth colour fields (every colour, every gradient) with
    a sharp-edged box of another colour on each (edges, as pictures have them)."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, 4, 4, generator=generator)
    fields = F.interpolate(coarse, size=(side, side), mode="bicubic", align_corners=False)
    rows, columns = ((torch.rand(count, 2, generator=generator) * side).long().sort().values
                     for _ in range(2))
    colours = torch.rand(count, 3, generator=generator)
    for field, (top, bottom), (left, right), colour in zip(
            fields, rows.tolist(), columns.tolist(), colours, strict=True):
        field[:, top:bottom + 1, left:right + 1] = colour[:, None, None]
    pixels = (fields.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1)
    return np.ascontiguousarray(pixels.numpy())


def fit_generic(model_dir: str | Path, *, write: bool = True) -> Projection:
    """The folder VAE's projection fitted on `generic_pictures` of GENERIC_LATENT_SIDE latents a
    side (written to `vae/preview.json` unless not `write`)."""
    side = GENERIC_LATENT_SIDE * spatial_factor(vae_config(model_dir))
    return fit_folder_projection(model_dir, generic_pictures(GENERIC_PICTURES, side), write=write)


def prepare_projection(model_dir: str | Path) -> Projection | None:
    """At prepare: fit `vae/preview.json` on generic pictures for a folder that has none and
    whose VAE is one previews know but too large for its DiT to decode them (a real
    checkpoint's). None: none needed, or the folder is read-only (no previews then).

    A small VAE's folder (the seeded built-ins) is left alone: fitting costs tens of seconds of
    encoding on a CPU at every first start, and such a DiT paints with `preview_painter:
    decoder` instead (tiny-shapes ships the projection it fitted at training)."""
    folder = Path(model_dir)
    if (folder / PROJECTION_FILE).is_file() or folder_vae_class(folder) is None:
        return None
    if decoder_paints(folder):
        return None
    try:
        return fit_generic(folder)
    except OSError as error:
        logger.warning("%s: no preview projection (%s); this model makes no previews",
                       folder, error)
        return None

