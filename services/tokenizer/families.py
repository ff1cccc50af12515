"""Which Tokenizer adapter serves a model folder: one engine, one adapter per model family.

The folder's family (`services.registry`, from the pipeline class its `model_index.json` names)
decides how prompts (and images) are encoded. Every adapter takes the same options and
hands the engine the same records (`PromptInput` in, `PromptEmbeddings` out), so the servicer
and the wire do not change with the family.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import TypedDict

from stagemesh.services import registry
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
    """How a family encodes its prompt (the values: services.registry's family names)."""

    QWEN_IMAGE = registry.QWEN_IMAGE  # Qwen2.5-VL over the prompt alone
    QWEN_IMAGE_EDIT = registry.QWEN_IMAGE_EDIT  # Qwen2.5-VL over the prompt and the input image
    WAN = registry.WAN  # UMT5 over the prompt, padded to max_sequence_length


def family_of(model_dir: Path) -> Family:
    """The folder's family; ValueError for one the stage cannot serve."""
    return Family(registry.served_family("tokenizer", model_dir, registry.DIFFUSION_FAMILIES).name)


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
