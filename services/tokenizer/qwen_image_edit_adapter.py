"""Tokenizer stage for Qwen-Image-Edit: the instruction read together with the input image.

Loads the `processor` (Qwen2.5-VL's: tokenizer + transformers' `Qwen2VLImageProcessorPil`, no
torchvision) and `text_encoder` (Qwen2.5-VL with its vision tower) of a diffusers
`QwenImageEditPipeline` folder and produces exactly what that pipeline's `encode_prompt` produces:
the input image resized the way `__call__` resizes its `prompt_image` (to the ~1024x1024-area
dimensions of `calculate_dimensions`, by `VaeImageProcessor.resize`: the family's
`resize_edit_image`), the edit template with its vision tokens, the system-prefix drop. The
negative prompt is read with the same image, as the pipeline's second `encode_prompt` call
reads it.

Batching: a step may hold several edit requests, but each text is encoded in its own forward
(a prompt, then its negative prompt, each with its request's image), as the pipeline's two
`encode_prompt` calls do. Why not one forward: a row's length follows its image's size (its
vision tokens), so a batch would pad rows to the longest, where the stock pipeline never pads
one prompt: unpadded forwards keep each request's embeddings exactly the pipeline's (the tests
compare them for equality), and the work is dominated by the vision tower, which runs per
image anyway. Text-to-image
folders keep their one-forward batches (`qwen_image_adapter.PromptEncoderAdapter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import PIL.Image
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline

from stagemesh.models.families.qwen_image import (
    PROMPT_MAX_TOKENS,
    PromptEmbeddings,
    condition_area,
    resize_edit_image,
)
from stagemesh.models.families.qwen_vl_processor import load_vl_processor
from stagemesh.services.tokenizer.base import (
    CPU,
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_SEQUENCE_LENGTH,
    MAX_IMAGE_PIXELS,
    PromptAdapterBase,
    PromptInput,
    PromptState,
    RgbArray,
    TokenCounter,
    TokenizerLimits,
)
from stagemesh.services.tokenizer.qwen_image_adapter import load_qwen_text_encoder
from stagemesh.shared.devices import CPU_FLOAT32, Placement
from stagemesh.shared.engine.adapter import InvalidInputError, NoStream, StageAdapter

#: QwenImageEditPipeline takes one input image (its `image` argument is a single image).
EDIT_IMAGES = 1


class EditPromptAdapter(PromptAdapterBase):
    """Qwen-Image-Edit: Qwen2.5-VL's processor + its text encoder with the vision tower."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        placement: Placement = CPU_FLOAT32,
    ) -> None:
        # Before any loading: a bad option fails at once.
        self.limits = TokenizerLimits.from_options(
            max_prompt_chars, max_sequence_length, PROMPT_MAX_TOKENS,
            max_images=EDIT_IMAGES, max_image_pixels=max_image_pixels,
        )
        processor = load_vl_processor(model_dir)
        self._condition_area = condition_area(model_dir)
        self.placement = placement
        self._device = placement.device
        # The stock pipeline with only its text side: its own encode_prompt (processor call,
        # template, system-prefix drop, mask rule) and its own image resizer make the
        # embeddings the pipeline's by construction. Components it does not need stay None.
        self._pipeline = QwenImageEditPipeline(
            scheduler=None,  # type: ignore[arg-type]
            vae=None,  # type: ignore[arg-type]
            text_encoder=load_qwen_text_encoder(model_dir, placement),
            tokenizer=processor.tokenizer,
            processor=processor,
            transformer=None,  # type: ignore[arg-type]
        )
        # Counts on the encoder's own Rust tokenizer, padding and truncation off (see there).
        self._counter = TokenCounter(processor.tokenizer)
        self._template: str = self._pipeline.prompt_template_encode
        self._template_start: int = self._pipeline.prompt_template_encode_start_idx

    @property
    def text_encoder(self) -> torch.nn.Module:
        encoder: torch.nn.Module = self._pipeline.text_encoder
        return encoder

    def prompt_token_count(self, text: str) -> int:
        """Text tokens the encoder keeps for `text`: the template's image markers (the image's
        place holder counted once) and suffix included, the image's own tokens not (the
        processor's pixel bounds cap those)."""
        n_ids = self._counter.count(self._template.format(text))
        return n_ids - self._template_start

    def _check_images(self, images: Sequence[RgbArray]) -> None:
        if not images:
            raise InvalidInputError("images", "an edit needs the image to edit")
        super()._check_images(images)

    def _condition_images(self, payload: PromptInput) -> tuple[PIL.Image.Image, ...]:
        """Each image resized as `QwenImageEditPipeline.__call__` resizes its `prompt_image`
        (the family's rule at the folder's condition area, which the VAE stage's encoder
        follows too)."""
        return tuple(resize_edit_image(PIL.Image.fromarray(image), self._condition_area)
                     for image in payload.images)

    @torch.inference_mode()
    def _encode_batch(self, states: Sequence[PromptState]) -> list[PromptEmbeddings]:
        return [self._encode_request(state).to(CPU) for state in states]

    def _encode_request(self, state: PromptState) -> PromptEmbeddings:
        """The pipeline's encode_prompt on the prompt, then on the negative prompt, each with
        the request's image; one forward each (see the module docstring)."""
        (image,) = state.images
        prompt_embeds, prompt_mask = self._encode(state.request.prompt, image)
        negative = state.request.negative_prompt
        if negative is None:
            return PromptEmbeddings(prompt_embeds, prompt_mask)
        negative_embeds, negative_mask = self._encode(negative, image)
        return PromptEmbeddings(prompt_embeds, prompt_mask, negative_embeds, negative_mask)

    def _encode(
        self, text: str, image: PIL.Image.Image
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        embeds: torch.Tensor
        mask: torch.Tensor | None  # None: every token valid (always so for one text)
        # diffusers annotates `image` as a tensor; its __call__ passes the resized PIL image
        # (`prompt_image`), which is what the processor reads.
        embeds, mask = self._pipeline.encode_prompt(
            prompt=text, image=image, device=self._device  # type: ignore[arg-type]
        )
        return embeds, mask


#: The static proof that the adapter is the Tokenizer stage's StageAdapter.
_: type[StageAdapter[PromptInput, NoStream, PromptState, NoStream, PromptEmbeddings]] = (
    EditPromptAdapter
)
