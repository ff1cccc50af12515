"""The previews' decoder painter, and which painter a DiT stage uses (`load_painter`).

A linear projection cannot draw what a decoder draws from a latent's neighbourhood: on
tiny-shapes (30 prompts, x0 at step 12 of 16) the fitted projection shows the asked colour in
the asked place 25 times and the asked shape 17 times where the final image shows it 27 times;
the VAE's own decoder shows 30 and 27, the final picture itself. But a decode costs what a tiny
model's step costs (tiny-shapes on one CPU thread: 33 ms against a 33 ms step; the projection
1.6 ms), so the projection stays the default and a stage opts into the decoder
(`preview_painter: decoder`). The DiT then loads its own float32 copy of the VAE, which only a
small VAE may be: a large one (Qwen-Image's and Wan 2.1's real VAEs, ~250 MB in bf16) would be
a second copy of big weights in the DiT stage, so those folders keep the projection.

The decoder decodes a latent grid no larger than the preview needs (the grid is area-pooled to
`ceil(size / factor)` latents on its long side first), so its cost follows the preview's size,
not the image's.
"""

from __future__ import annotations

import enum
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

from stagemesh.services.dit.preview import PROJECTION_FILE, Painter, Projection
from stagemesh.services.vae.kinds import VaeModel, latent_stats
from stagemesh.services.vae.qwen_image_adapter import denormalize
from stagemesh.services.vae.single_frame import use_single_frame_convs

logger = logging.getLogger(__name__)

#: The most bytes of VAE weights the DiT loads a copy of to decode previews (tiny-shapes' VAE:
#: 2.6 MB; Qwen-Image's and Wan 2.1's real ones: ~250 MB, which keep the projection).
MAX_DECODER_BYTES = 32 * 2**20
#: vae/config.json `_class_name` -> the class whose decoder paints previews.
VAE_CLASSES: dict[str, type[VaeModel]] = {
    "AutoencoderKLQwenImage": AutoencoderKLQwenImage, "AutoencoderKLWan": AutoencoderKLWan}


class PainterChoice(enum.Enum):
    """The DiT stage option `preview_painter`: what paints its previews."""

    #: The folder's linear projection (`vae/preview.json`): ~1 ms a preview, the default.
    PROJECTION = "projection"
    #: The VAE's own decoder when its weights are at most MAX_DECODER_BYTES (else, with a
    #: warning, the projection): the final picture's look, at the cost of a small decode.
    DECODER = "decoder"


class PreviewStageOptions(TypedDict, total=False):
    """The DiT's preview option (flat; the painter in force is in the stage's facts)."""

    preview_painter: str  # projection | decoder


def painter_choice(options: PreviewStageOptions) -> PainterChoice:
    name = options.get("preview_painter", PainterChoice.PROJECTION.value)
    try:
        return PainterChoice(name)
    except ValueError:
        raise ValueError(f"option preview_painter must be one of "
                         f"{[choice.value for choice in PainterChoice]}, got {name!r}") from None


class DecoderPainter:
    """x0 through the folder VAE's own decoder, in float32 on the DiT's device."""

    def __init__(self, vae: VaeModel) -> None:
        self.vae = vae.eval()
        use_single_frame_convs(vae)  # a preview is one frame: 2-D convs, a third of the cost
        self.mean, self.std = (stat.to(vae.device) for stat in latent_stats(vae))
        self.factor = spatial_factor(vae.config)

    @property
    def name(self) -> str:
        return "decoder"

    @classmethod
    def load(cls, model_dir: str | Path, vae_class: type[VaeModel],
             device: torch.device) -> DecoderPainter:
        vae = vae_class.from_pretrained(model_dir, subfolder="vae", local_files_only=True,
                                        dtype=torch.float32, device_map=str(device))
        return cls(vae)

    def to_rgb(self, grid: torch.Tensor, size: int) -> torch.Tensor:
        latents = _pooled(grid.to(self.vae.device, torch.float32), math.ceil(size / self.factor))
        decoded: torch.Tensor = self.vae.decode(
            denormalize(latents[None, :, None], self.mean, self.std), return_dict=False,
        )[0]  # [1, 3, 1, H, W] in [-1, 1]
        return ((decoded[0, :, 0] + 1.0) / 2.0).clamp(0.0, 1.0)


def spatial_factor(vae_config: Mapping[str, Any]) -> int:
    """Pixels per latent on each side: one 2x downsample per `temperal_downsample` entry."""
    downsamples: list[bool] = vae_config["temperal_downsample"]
    return int(2 ** len(downsamples))


def _pooled(grid: torch.Tensor, most: int) -> torch.Tensor:
    """The latent grid [C, h, w] area-pooled to at most `most` latents on its long side."""
    height, width = grid.shape[1:]
    if max(height, width) <= most:
        return grid
    scale = most / max(height, width)
    shape = (max(1, round(height * scale)), max(1, round(width * scale)))
    return F.interpolate(grid[None], size=shape, mode="area")[0]


def vae_weight_bytes(model_dir: str | Path) -> int:
    """The bytes of the folder's VAE weights (0: none there)."""
    return sum(path.stat().st_size for path in (Path(model_dir) / "vae").glob("*.safetensors"))


def vae_config(model_dir: str | Path) -> dict[str, Any]:
    """The folder's vae/config.json ({} when it has none)."""
    path = Path(model_dir) / "vae" / "config.json"
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def folder_vae_class(model_dir: str | Path) -> type[VaeModel] | None:
    """The class of the folder's VAE (vae/config.json), if it is one previews know."""
    return VAE_CLASSES.get(str(vae_config(model_dir).get("_class_name")))


def decoder_paints(model_dir: str | Path) -> bool:
    """Whether the folder's previews come from its VAE's decoder: a VAE previews know, with
    weights of at most MAX_DECODER_BYTES."""
    return (folder_vae_class(model_dir) is not None
            and 0 < vae_weight_bytes(model_dir) <= MAX_DECODER_BYTES)


def load_painter(model_dir: str | Path, device: torch.device,
                 choice: PainterChoice = PainterChoice.PROJECTION) -> Painter | None:
    """The folder's preview painter: with DECODER its VAE's decoder when `decoder_paints`;
    else its projection (`vae/preview.json`); else None (no previews)."""
    vae_class = folder_vae_class(model_dir)
    if choice is PainterChoice.DECODER:
        if vae_class is not None and decoder_paints(model_dir):
            logger.info("previews: the VAE's decoder (%.1f MB) on %s",
                        vae_weight_bytes(model_dir) / 1e6, device)
            return DecoderPainter.load(model_dir, vae_class, device)
        logger.warning("previews: %s's VAE is not one the DiT copies (a known class, at most "
                       "%d MB of weights): the projection paints them", model_dir,
                       MAX_DECODER_BYTES // 2**20)
    projection = Projection.load(model_dir)
    if projection is None:
        return None
    logger.info("previews: the linear projection %s", Path(model_dir) / PROJECTION_FILE)
    return projection.to(device)
