"""The Qwen-Image family (diffusers `QwenImagePipeline` folders): what its stages share.

The Tokenizer stage produces `PromptEmbeddings` and the DiT stage consumes them; both read the
family's facts here, so neither imports the other.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
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
#: A folder's own condition area, where it is not the stock one: `{"condition_area": pixels}`.
#: A model trained at a small size (tiny-shapes-edit: 32x32) conditions at that size; read by
#: `condition_area`, the one place the Tokenizer, VAE and DiT stages learn it from.
CONDITION_FILE = "condition.json"


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


def condition_area(model_dir: str | Path) -> int:
    """The pixel area an edit folder resizes its input image to: its CONDITION_FILE's
    `condition_area`, else the stock pipeline's EDIT_IMAGE_AREA."""
    path = Path(model_dir) / CONDITION_FILE
    if not path.exists():
        return EDIT_IMAGE_AREA
    area = json.loads(path.read_text()).get("condition_area")
    if not isinstance(area, int) or area <= 0:
        raise ValueError(f"{path}: condition_area must be a positive integer, got {area!r}")
    return area


def write_condition_area(model_dir: str | Path, area: int) -> None:
    """Records in a folder that it conditions at `area` pixels (read by `condition_area`)."""
    (Path(model_dir) / CONDITION_FILE).write_text(json.dumps({"condition_area": area}) + "\n")


def edit_image_size(width: int, height: int, area: int = EDIT_IMAGE_AREA) -> tuple[int, int]:
    """(width, height) the edit pipeline resizes a `width` x `height` input image to: its own
    `calculate_dimensions(area, width / height)` (called, not re-derived; the stock pipeline's
    area is EDIT_IMAGE_AREA)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    new_width, new_height, _ = calculate_dimensions(area, width / height)
    return int(new_width), int(new_height)


def resize_edit_image(image: Image.Image, area: int = EDIT_IMAGE_AREA) -> Image.Image:
    """The input image as the edit pipeline resizes it (PIL lanczos via `VaeImageProcessor`):
    the image its processor reads, and the one its VAE encodes."""
    from diffusers.image_processor import VaeImageProcessor

    width, height = edit_image_size(*image.size, area=area)
    resized: Image.Image = VaeImageProcessor().resize(image, height, width)
    return resized


@contextlib.contextmanager
def stock_condition_area(area: int) -> Iterator[None]:
    """Makes the stock `QwenImageEditPipeline` resize its input to `area` pixels, not ~1 Mpx.

    The pipeline calls its module's `calculate_dimensions(1024 * 1024, ratio)` with the area
    written in; this swaps that function for one that ignores the written area and uses
    `area` (a folder's `condition_area`). Used where the stock pipeline is the reference for a
    folder that conditions at its own size (parity tests, in-process evaluation).
    """
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    original = module.calculate_dimensions

    def at_area(target_area: int, ratio: float) -> tuple[int, int, None]:
        del target_area  # the stock 1024 * 1024
        width, height, _ = original(area, ratio)  # type: ignore[no-untyped-call]  # diffusers'
        return width, height, None

    module.calculate_dimensions = at_area
    try:
        yield
    finally:
        module.calculate_dimensions = original
