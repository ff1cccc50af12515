"""The two VAEs the stage serves, and what each does its own way.

A folder's `vae/config.json` names its class: `AutoencoderKLQwenImage` (Qwen-Image and
Qwen-Image-Edit: images) or `AutoencoderKLWan` (Wan 2.x: video). Both are the same causal 3D
autoencoder with a feature cache over temporal chunks, so one encoder loop and one decoder loop
serve both; what differs is how their stock pipelines prepare an image for `vae.encode` and how
they normalize the latents, and that is all an `ImageEncoding` holds:

- QwenImageEditPipeline: `image_processor.resize(image, h, w)` then `preprocess(image, h, w)`
  (a VaeImageProcessor of factor 2 x the VAE's), and `(latents - mean) / std`.
- WanImageToVideoPipeline: `video_processor.preprocess(image, height, width)`, and
  `WanGeometry.normalize` in float32 (its `prepare_latents` runs in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias

import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.video_processor import VideoProcessor

from stagemesh.models.families.qwen_image import EDIT_IMAGE_AREA, edit_image_size
from stagemesh.models.families.wan import WanGeometry
from stagemesh.shared.devices import Placement

#: Either VAE; their encoders share one interface (`encoder(x, feat_cache, feat_idx)`).
VaeModel: TypeAlias = AutoencoderKLQwenImage | AutoencoderKLWan

#: A causal conv's cache slot, per conv: None (not yet run), "Rep" (the Wan upsampler's first
#: chunk) or the last frames it saw. The models fill slots by assignment only, never in place,
#: so a shallow copy of the list is a snapshot: a step that stops part-way leaves it as it was.
FeatureCache: TypeAlias = list[torch.Tensor | str | None]


def load_wan_vae(model_dir: str | Path, placement: Placement) -> AutoencoderKLWan:
    """The folder's AutoencoderKLWan, straight onto its device in its dtype."""
    vae: AutoencoderKLWan = AutoencoderKLWan.from_pretrained(
        model_dir, subfolder="vae", local_files_only=True, dtype=placement.dtype,
        device_map=placement.device_name,
    )
    return vae.eval()


def cache_slots(module: torch.nn.Module, conv_type: type[torch.nn.Module]) -> int:
    """The slots of `module`'s feature cache: one per causal conv, as `vae.clear_cache` counts."""
    return sum(isinstance(layer, conv_type) for layer in module.modules())


def latent_stats(vae: VaeModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's latents_mean and latents_std, shaped [1, z_dim, 1, 1, 1] (float32, CPU),
    as the pipelines build them before moving them to the latents."""
    shape = (1, vae.config["z_dim"], 1, 1, 1)
    return (torch.tensor(vae.config["latents_mean"]).view(shape),
            torch.tensor(vae.config["latents_std"]).view(shape))


class ImageEncoding(Protocol):
    """How a VAE's stock pipeline prepares an image for `vae.encode` and normalizes latents."""

    def preprocess(self, image: PIL.Image.Image, height: int, width: int) -> torch.Tensor:
        """[1, 3, height, width] float32 in [-1, 1]."""
        ...

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The posterior mode as the pipeline hands it to the transformer."""
        ...


@dataclass(frozen=True)
class QwenEditEncoding:
    """QwenImageEditPipeline's: `__call__` step 3 and `_encode_vae_image`."""

    processor: VaeImageProcessor  # VaeImageProcessor(vae_scale_factor=latent factor)
    mean: torch.Tensor
    std: torch.Tensor
    area: int = EDIT_IMAGE_AREA  # the folder's condition area (`condition_area`)

    @classmethod
    def of(cls, vae: AutoencoderKLQwenImage, latent_factor: int,
           area: int = EDIT_IMAGE_AREA) -> QwenEditEncoding:
        return cls(VaeImageProcessor(vae_scale_factor=latent_factor), *latent_stats(vae), area)

    def preprocess(self, image: PIL.Image.Image, height: int, width: int) -> torch.Tensor:
        if self.area != EDIT_IMAGE_AREA:
            # A folder that conditions at its own area: the size asked for follows the stock
            # ~1 Mpx rule (the gateway's), the model was trained at this one.
            width, height = edit_image_size(image.width, image.height, self.area)
        resized = self.processor.resize(image, height, width)
        pixels: torch.Tensor = self.processor.preprocess(resized, height, width)
        return pixels

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        mean = self.mean.to(latents.device, latents.dtype)
        std = self.std.to(latents.device, latents.dtype)
        return (latents - mean) / std


@dataclass(frozen=True)
class WanI2VEncoding:
    """WanImageToVideoPipeline's: `video_processor.preprocess` and `prepare_latents`."""

    processor: VideoProcessor  # VideoProcessor(vae_scale_factor=spatial factor)
    geometry: WanGeometry

    @classmethod
    def of(cls, geometry: WanGeometry) -> WanI2VEncoding:
        return cls(VideoProcessor(vae_scale_factor=geometry.spatial_factor), geometry)

    def preprocess(self, image: PIL.Image.Image, height: int, width: int) -> torch.Tensor:
        pixels: torch.Tensor = self.processor.preprocess(image, height=height, width=width)
        return pixels.to(torch.float32)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        return self.geometry.normalize(latents.to(torch.float32))  # in the pipeline's dtype
