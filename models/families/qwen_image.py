"""The Qwen-Image family (diffusers `QwenImagePipeline` folders): what its stages share.

The Tokenizer stage produces `PromptEmbeddings` and the DiT stage consumes them; both read the
family's facts here, so neither imports the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

#: QwenImagePipeline's `tokenizer_max_length`: the most prompt tokens its text encoder keeps.
PROMPT_MAX_TOKENS = 1024
#: Largest image height or width any Qwen-Image stage accepts, in pixels; bounds the latent
#: memory of one request (the DiT may be configured lower, never higher).
MAX_IMAGE_SIDE = 2048
#: `QwenImageEditPipeline` resizes its input image to about this many pixels (aspect ratio
#: kept, sides multiples of 32) whatever output size is asked; the resized image is what both
#: the vision-language processor (Tokenizer stage) and the VAE encoder (VAE stage) see.
EDIT_IMAGE_AREA = 1024 * 1024


@dataclass(frozen=True)
class PromptEmbeddings:
    """What `QwenImagePipeline.encode_prompt` returns for a prompt (and a negative prompt).

    A mask is None when every token is valid (the pipeline drops all-ones masks).
    """

    prompt_embeds: torch.Tensor  # [1, seq, hidden]
    prompt_embeds_mask: torch.Tensor | None  # [1, seq] int64
    negative_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> PromptEmbeddings:
        """The same embeddings on `device`, in `dtype` if given (masks keep theirs); tensors
        already there are not copied."""

        def move(tensor: torch.Tensor | None, cast: torch.dtype | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device=device, dtype=cast)

        return PromptEmbeddings(
            self.prompt_embeds.to(device=device, dtype=dtype),
            move(self.prompt_embeds_mask, None),
            move(self.negative_prompt_embeds, dtype),
            move(self.negative_prompt_embeds_mask, None),
        )


def latent_factor(model_dir: str | Path) -> int:
    """What image height and width must be a multiple of: the VAE's spatial factor x 2 (packing).

    Read from the folder's `vae/config.json`, the way `QwenImagePipeline` derives it.
    """
    vae_config = json.loads((Path(model_dir) / "vae" / "config.json").read_text())
    downsample = vae_config["temperal_downsample"]
    if not isinstance(downsample, list):
        raise ValueError(f"{model_dir}/vae/config.json: temperal_downsample must be a list")
    spatial_factor: int = 2 ** len(downsample)  # one 2x downsample per entry
    return spatial_factor * 2


def edit_image_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) the edit pipeline resizes a `width` x `height` input image to: its own
    `calculate_dimensions(EDIT_IMAGE_AREA, width / height)` (called, not re-derived)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    new_width, new_height, _ = calculate_dimensions(EDIT_IMAGE_AREA, width / height)
    return int(new_width), int(new_height)


def resize_edit_image(image: Image.Image) -> Image.Image:
    """The input image as the edit pipeline resizes it (PIL lanczos via `VaeImageProcessor`):
    the image its processor reads, and the one its VAE encodes."""
    from diffusers.image_processor import VaeImageProcessor

    width, height = edit_image_size(*image.size)
    resized: Image.Image = VaeImageProcessor().resize(image, height, width)
    return resized
