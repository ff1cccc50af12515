"""Tokenizer stage for Qwen-Image: prompt text -> text-encoder embeddings.

Loads the `tokenizer` and `text_encoder` components of a diffusers Qwen-Image folder and produces
exactly what `QwenImagePipeline.encode_prompt` produces, in a single engine step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImagePipeline
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, StepOutput

#: QwenImagePipeline's default `max_sequence_length`.
DEFAULT_MAX_SEQUENCE_LENGTH = 512


@dataclass(frozen=True)
class PromptInput:
    """One prompt to encode. A negative prompt (even "") is what enables true CFG downstream."""

    prompt: str
    negative_prompt: str | None = None
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH


@dataclass(frozen=True)
class PromptEmbeddings:
    """The Tokenizer stage's result, as `QwenImagePipeline.encode_prompt` returns it.

    A mask is None when every token is valid (the pipeline drops all-ones masks).
    """

    prompt_embeds: torch.Tensor  # [1, seq, hidden]
    prompt_embeds_mask: torch.Tensor | None  # [1, seq] int64
    negative_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None


@dataclass
class PromptState:
    request: PromptInput
    result: PromptEmbeddings | None = None


class PromptEncoderAdapter:
    """`StageAdapter[PromptState]` over Qwen-Image's tokenizer + Qwen2.5-VL text encoder."""

    stage = "tokenizer"

    def __init__(self, model_dir: str | Path) -> None:
        tokenizer = Qwen2Tokenizer.from_pretrained(
            model_dir, subfolder="tokenizer", local_files_only=True
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir, subfolder="text_encoder", local_files_only=True
        ).eval()
        self._device = text_encoder.device
        # A text-only pipeline: its own encode_prompt (template, system-prefix drop, padding and
        # mask rules) makes the embeddings the pipeline's by construction.
        self._pipeline = QwenImagePipeline(
            scheduler=None,
            vae=None,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=None,
        )
        self._tokenizer = tokenizer

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: Any) -> None:
        if not isinstance(payload, PromptInput):
            raise TypeError(f"expected PromptInput, got {type(payload).__name__}")
        limit = self._pipeline.tokenizer_max_length
        length = payload.max_sequence_length
        if not 1 <= length <= limit:
            raise InvalidInputError(
                "max_sequence_length", f"max_sequence_length must be in [1, {limit}], got {length}"
            )
        if not payload.prompt.strip():
            raise InvalidInputError("prompt", "prompt must not be empty")
        self._check_length("prompt", payload.prompt, length)
        if payload.negative_prompt is not None:
            self._check_length("negative_prompt", payload.negative_prompt, length)

    def prompt_token_count(self, text: str) -> int:
        """Tokens the text encoder keeps for `text` (the template's suffix included)."""
        templated = self._pipeline.prompt_template_encode.format(text)
        n_ids = len(self._tokenizer(templated).input_ids)
        return n_ids - self._pipeline.prompt_template_encode_start_idx

    def _check_length(self, field_name: str, text: str, max_sequence_length: int) -> None:
        # The pipeline would silently cut the embeddings; the mesh refuses instead.
        n_tokens = self.prompt_token_count(text)
        if n_tokens > max_sequence_length:
            raise InvalidInputError(
                field_name,
                f"{field_name} is {n_tokens} tokens long; the limit is {max_sequence_length}",
            )

    # -- step machine -------------------------------------------------------------------------

    def prepare(self, request: EngineRequest) -> PromptState:
        return PromptState(request=request.payload)

    def add_input(self, state: PromptState, payload: Any) -> None:
        raise NotImplementedError("the tokenizer stage takes no streamed input")

    def step(self, states: Sequence[PromptState]) -> list[StepOutput]:
        outputs = []
        for state in states:
            state.result = self._encode_request(state.request)
            outputs.append(StepOutput(step_index=1, finished=True))
        return outputs

    def finish(self, state: PromptState) -> PromptEmbeddings:
        if state.result is None:
            raise RuntimeError("finish() before the encoding step ran")
        return state.result

    def release(self, state: PromptState) -> None:
        state.result = None

    def batch_key(self, state: PromptState) -> Hashable:
        return None  # any prompts may share a step; each is encoded on its own for now

    # -- phases -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _encode_request(self, request: PromptInput) -> PromptEmbeddings:
        embeds, mask = self._encode(request.prompt, request.max_sequence_length)
        if request.negative_prompt is None:
            return PromptEmbeddings(embeds, mask)
        neg_embeds, neg_mask = self._encode(request.negative_prompt, request.max_sequence_length)
        return PromptEmbeddings(embeds, mask, neg_embeds, neg_mask)

    def _encode(
        self, text: str, max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        embeds, mask = self._pipeline.encode_prompt(
            prompt=text, device=self._device, max_sequence_length=max_sequence_length
        )
        return embeds, mask
