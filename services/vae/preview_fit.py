"""Fits a model folder's latent-to-RGB preview projection (`vae/preview.json`) from its VAE.

The DiT stage's step previews (services/dit/preview.py) turn latents into pixels with a linear
map that belongs to the VAE. It is fitted once per folder: encode known pictures with the VAE,
normalize the latents as the DiT holds them, and solve least squares for each latent pixel's
block of pixels. Pictures like the model's own make the best fit (tiny-shapes: its renders).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage

from stagemesh.services.dit.preview import Projection, fit_projection
from stagemesh.services.vae.kinds import latent_stats

logger = logging.getLogger(__name__)

#: Pictures encoded at once while fitting (bounds the encoder's memory).
ENCODE_CHUNK = 64


@torch.inference_mode()
def fit_folder_projection(model_dir: str | Path, pictures: npt.NDArray[np.uint8]) -> Projection:
    """The projection for the folder's Qwen-Image VAE, fitted on uint8 RGB `pictures`
    [n, height, width, 3]; written to `vae/preview.json` as well."""
    vae = AutoencoderKLQwenImage.from_pretrained(model_dir, subfolder="vae",
                                                 local_files_only=True).eval()
    mean, std = latent_stats(vae)
    pixels = torch.from_numpy(pictures).permute(0, 3, 1, 2).float() / 255.0  # [n, 3, H, W]
    latents = []
    for chunk in torch.split(pixels, ENCODE_CHUNK):
        encoded = vae.encode((chunk * 2 - 1)[:, :, None]).latent_dist.mode()
        latents.append(((encoded - mean) / std)[:, :, 0])
    grid = torch.cat(latents)
    projection = fit_projection(grid, pixels, factor=pixels.shape[-1] // grid.shape[-1])
    path = projection.save(Path(model_dir))
    logger.info("fitted %s on %d pictures (factor %d)", path, len(pictures), projection.factor)
    return projection
