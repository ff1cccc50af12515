"""Which Tokenizer adapter serves a model folder: one engine, one adapter per model family.

The folder's `model_index.json` names its diffusers pipeline (`_class_name`); the family of that
pipeline decides how prompts (and images) are encoded. Every adapter takes the same options and
hands the engine the same records (`PromptInput` in, `PromptEmbeddings` out), so the servicer
and the wire do not change with the family.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import TypedDict

from stagemesh.services.folders import folder_class
from stagemesh.services.tokenizer.base import PromptAdapterBase
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter
from stagemesh.services.tokenizer.qwen_image_edit_adapter import EditPromptAdapter
from stagemesh.services.tokenizer.wan_adapter import WanPromptAdapter
from stagemesh.shared.devices import Placement

logger = logging.getLogger(__name__)


class TextOptions(TypedDict, total=False):
    """The options every family takes (each capped by the model)."""

    max_prompt_chars: int
    max_sequence_length: int


class TokenizerOptions(TextOptions, total=False):
    """The stage's recipe options."""

    max_image_pixels: int  # families that read images only; others ignore it with a warning


class Family(enum.Enum):
    """How a pipeline encodes its prompt."""

    QWEN_IMAGE = "qwen-image"  # Qwen2.5-VL over the prompt alone
    QWEN_IMAGE_EDIT = "qwen-image-edit"  # Qwen2.5-VL over the prompt and the input image
    WAN = "wan"  # UMT5 over the prompt, padded to max_sequence_length


#: diffusers pipeline class (model_index.json `_class_name`) -> its family.
PIPELINE_FAMILIES: dict[str, Family] = {
    "QwenImagePipeline": Family.QWEN_IMAGE,
    "QwenImageEditPipeline": Family.QWEN_IMAGE_EDIT,
    "WanPipeline": Family.WAN,
    "WanImageToVideoPipeline": Family.WAN,
}


def family_of(model_dir: Path) -> Family:
    """The family of the folder's pipeline; ValueError for a pipeline the stage cannot serve."""
    class_name = folder_class(model_dir)
    family = PIPELINE_FAMILIES.get(class_name) if class_name is not None else None
    if family is None:
        raise ValueError(
            f"{model_dir}/model_index.json: the tokenizer stage serves "
            f"{sorted(PIPELINE_FAMILIES)}, not {class_name!r}"
        )
    return family


def build_adapter(
    model_dir: Path, options: TokenizerOptions, placement: Placement
) -> PromptAdapterBase:
    """The family's adapter for the folder, with the recipe's options."""
    family = family_of(model_dir)
    text_options = TextOptions()
    if "max_prompt_chars" in options:
        text_options["max_prompt_chars"] = options["max_prompt_chars"]
    if "max_sequence_length" in options:
        text_options["max_sequence_length"] = options["max_sequence_length"]
    pixels = options.get("max_image_pixels")
    if family is Family.QWEN_IMAGE_EDIT:
        if pixels is None:
            return EditPromptAdapter(model_dir, **text_options, placement=placement)
        return EditPromptAdapter(
            model_dir, **text_options, max_image_pixels=pixels, placement=placement
        )
    if pixels is not None:
        logger.warning("option max_image_pixels has no effect: %s reads text only", model_dir)
    if family is Family.WAN:
        return WanPromptAdapter(model_dir, **text_options, placement=placement)
    return PromptEncoderAdapter(model_dir, **text_options, placement=placement)
