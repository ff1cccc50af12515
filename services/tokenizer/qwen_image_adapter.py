"""Tokenizer stage for Qwen-Image (text-to-image): Qwen2.5-VL text-encoder embeddings.

Qwen-Image batching: one step encodes every prompt and negative prompt of its batch in one
text-encoder forward (the pipeline's own encode_prompt over a list: template, right padding to
the longest, system-prefix drop), then hands each request its own rows cut to their valid
length, which is what the request encoded alone gets (one prompt alone needs no mask: the
pipeline drops an all-ones mask to None). Right padding keeps every valid token at the position
it has alone, and the causal text encoder never lets a valid token see the padding after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from stagemesh.models.families.qwen_image import PROMPT_MAX_TOKENS, PromptEmbeddings
from stagemesh.services.tokenizer.base import (
    CPU,
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_SEQUENCE_LENGTH,
    PromptAdapterBase,
    PromptInput,
    PromptState,
    TokenCounter,
    TokenizerLimits,
    encode_distinct,
)
from stagemesh.shared.devices import CPU_FLOAT32, Placement
from stagemesh.shared.engine.adapter import NoStream, StageAdapter


class PromptEncoderAdapter(PromptAdapterBase):
    """Qwen-Image (text-to-image): Qwen-Image's tokenizer + Qwen2.5-VL text encoder."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
        placement: Placement = CPU_FLOAT32,
    ) -> None:
        tokenizer = Qwen2Tokenizer.from_pretrained(
            model_dir, subfolder="tokenizer", local_files_only=True
        )
        self.placement = placement
        self._device = placement.device
        # A text-only pipeline: its own encode_prompt (template, system-prefix drop, padding and
        # mask rules) makes the embeddings the pipeline's by construction. diffusers types every
        # component as required, but a pipeline may leave components out (None).
        self._pipeline = QwenImagePipeline(
            scheduler=None,  # type: ignore[arg-type]
            vae=None,  # type: ignore[arg-type]
            text_encoder=load_qwen_text_encoder(model_dir, placement),
            tokenizer=tokenizer,
            transformer=None,  # type: ignore[arg-type]
        )
        # Batched rows keep their tokens' positions (see the module docstring); the pipeline
        # pads on the tokenizer's side.
        tokenizer.padding_side = "right"
        self._counter = TokenCounter(tokenizer)  # padding off while counting (see there)
        self._template: str = self._pipeline.prompt_template_encode
        self._template_start: int = self._pipeline.prompt_template_encode_start_idx
        self.limits = TokenizerLimits.from_options(
            max_prompt_chars, max_sequence_length, PROMPT_MAX_TOKENS
        )

    @property
    def text_encoder(self) -> torch.nn.Module:
        encoder: torch.nn.Module = self._pipeline.text_encoder
        return encoder

    def prompt_token_count(self, text: str) -> int:
        """Tokens the text encoder keeps for `text` (the template's suffix included)."""
        n_ids = self._counter.count(self._template.format(text))
        return n_ids - self._template_start

    @torch.inference_mode()
    def _encode_batch(self, states: Sequence[PromptState]) -> list[PromptEmbeddings]:
        prompts = [state.request.prompt for state in states]
        negatives = [
            state.request.negative_prompt
            for state in states
            if state.request.negative_prompt is not None
        ]
        # One forward: the prompts, then the negative prompts, each in the states' order.
        rows = iter(self._encode(prompts + negatives))
        embeds = [next(rows) for _ in states]
        results: list[PromptEmbeddings] = []
        for state, prompt_embeds in zip(states, embeds, strict=True):
            length = state.max_sequence_length
            if state.request.negative_prompt is None:
                result = PromptEmbeddings(prompt_embeds[:, :length], None)
            else:
                result = PromptEmbeddings(prompt_embeds[:, :length], None, next(rows)[:, :length])
            results.append(result.to(CPU))
        return results

    def _encode(self, texts: list[str]) -> list[torch.Tensor]:
        """[1, tokens, hidden] per text, each cut to its own tokens, from one forward."""
        return encode_distinct(texts, self._encode_rows)

    def _encode_rows(self, texts: list[str]) -> list[torch.Tensor]:
        embeds: torch.Tensor
        mask: torch.Tensor | None
        embeds, mask = self._pipeline.encode_prompt(
            prompt=texts,
            device=self._device,
            max_sequence_length=self._pipeline.tokenizer_max_length,
        )
        width = embeds.shape[1]
        lengths = [width] * len(texts) if mask is None else mask.sum(dim=1).tolist()
        return [embeds[row : row + 1, :length].clone() for row, length in enumerate(lengths)]


def load_qwen_text_encoder(
    model_dir: str | Path, placement: Placement
) -> Qwen2_5_VLForConditionalGeneration:
    """The folder's Qwen2.5-VL text encoder, where `placement` says, in eval mode."""
    text_encoder: Qwen2_5_VLForConditionalGeneration = (
        Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir,
            subfolder="text_encoder",
            local_files_only=True,
            dtype=placement.dtype,
            device_map=placement.device_name,
        )
    )  # from_pretrained leaves it in eval mode
    return text_encoder


#: The static proof that the adapter is the Tokenizer stage's StageAdapter.
_: type[StageAdapter[PromptInput, NoStream, PromptState, NoStream, PromptEmbeddings]] = (
    PromptEncoderAdapter
)
