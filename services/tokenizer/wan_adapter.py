"""Tokenizer stage for Wan (text- and image-to-video): prompt text -> UMT5 embeddings.

Loads the `tokenizer` (T5-style) and `text_encoder` (`UMT5EncoderModel`) of a diffusers
`WanPipeline` or `WanImageToVideoPipeline` folder and produces exactly what `WanPipeline.
encode_prompt` produces (the image-to-video pipeline's `encode_prompt` and
`_get_t5_prompt_embeds` are "Copied from" these): the prompt cleaned (`prompt_clean`), tokenized
to `max_sequence_length` (512 unless asked), encoded, trimmed to its real length and zero-padded
back, so the embeddings are always [1, max_sequence_length, dim]. No mask is sent: the stock
pipelines hand the transformer the zero-padded embeddings alone. The negative prompt is encoded
likewise, only when given (the stock pipeline encodes "" when guidance is on and none is given:
the gateway sends its default negative prompt). Wan's image-to-video reads the image through the
VAE, never through the text encoder, so this stage takes no images.

Batching: one step encodes every prompt and negative prompt of its batch in one forward. The
pipeline pads each row to `max_sequence_length` with an attention mask whatever its batch, so a
row's values do not depend on its batch mates; requests asking for different lengths never
share a step (`batch_key`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path

import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline, prompt_clean
from transformers import AutoTokenizer, PreTrainedTokenizerBase, UMT5EncoderModel

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.families.wan import PROMPT_MAX_TOKENS
from stagemesh.services.tokenizer.base import (
    CPU,
    DEFAULT_MAX_PROMPT_CHARS,
    PromptAdapterBase,
    PromptInput,
    PromptState,
    TokenCounter,
    TokenizerLimits,
    encode_distinct,
)
from stagemesh.shared.devices import CPU_FLOAT32, Placement
from stagemesh.shared.engine.adapter import NoStream, StageAdapter


class WanPromptAdapter(PromptAdapterBase):
    """Wan 2.x: a T5-style tokenizer + the UMT5 text encoder."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        max_sequence_length: int = PROMPT_MAX_TOKENS,
        placement: Placement = CPU_FLOAT32,
    ) -> None:
        # Before any loading: a bad option fails at once.
        self.limits = TokenizerLimits.from_options(
            max_prompt_chars, max_sequence_length, PROMPT_MAX_TOKENS
        )
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            model_dir, subfolder="tokenizer", local_files_only=True
        )
        text_encoder: UMT5EncoderModel = UMT5EncoderModel.from_pretrained(
            model_dir,
            subfolder="text_encoder",
            local_files_only=True,
            dtype=placement.dtype,
            device_map=placement.device_name,
        )  # from_pretrained leaves it in eval mode
        self.placement = placement
        self._device = placement.device
        # The stock pipeline with only its text side (see the module docstring); diffusers
        # types the VAE and scheduler as required, a pipeline may leave them out (None).
        self._pipeline = WanPipeline(
            # diffusers annotates the AutoTokenizer factory; any loaded tokenizer is meant.
            tokenizer=tokenizer,  # type: ignore[arg-type]
            text_encoder=text_encoder,
            vae=None,  # type: ignore[arg-type]
            scheduler=None,  # type: ignore[arg-type]
        )
        # Counts on the encoder's own Rust tokenizer, padding and truncation off (see there).
        self._counter = TokenCounter(tokenizer)

    @property
    def text_encoder(self) -> torch.nn.Module:
        encoder: torch.nn.Module = self._pipeline.text_encoder
        return encoder

    def prompt_token_count(self, text: str) -> int:
        """Tokens the pipeline keeps for `text`: the cleaned text's, end-of-sequence included."""
        return self._counter.count(prompt_clean(text))

    def batch_key(self, state: PromptState) -> Hashable:
        return state.max_sequence_length  # every row of a forward is padded to this length

    @torch.inference_mode()
    def _encode_batch(self, states: Sequence[PromptState]) -> list[PromptEmbeddings]:
        (length,) = {state.max_sequence_length for state in states}  # one batch key
        prompts = [state.request.prompt for state in states]
        negatives = [
            state.request.negative_prompt
            for state in states
            if state.request.negative_prompt is not None
        ]
        # One forward: the prompts, then the negative prompts, each in the states' order.
        rows = iter(self._encode(prompts + negatives, length))
        embeds = [next(rows) for _ in states]
        results: list[PromptEmbeddings] = []
        for state, prompt_embeds in zip(states, embeds, strict=True):
            negative_embeds = None if state.request.negative_prompt is None else next(rows)
            results.append(PromptEmbeddings(prompt_embeds, None, negative_embeds).to(CPU))
        return results

    def _encode(self, texts: list[str], length: int) -> list[torch.Tensor]:
        """[1, length, dim] per text (zeros past its tokens), from one forward over the
        distinct texts."""

        def forward(distinct: list[str]) -> list[torch.Tensor]:
            embeds: torch.Tensor
            embeds, _ = self._pipeline.encode_prompt(
                prompt=distinct,
                do_classifier_free_guidance=False,  # negative prompts are rows of `texts`
                max_sequence_length=length,
                device=self._device,
            )
            return [embeds[row : row + 1].clone() for row in range(len(distinct))]

        return encode_distinct(texts, forward)


#: The static proof that the adapter is the Tokenizer stage's StageAdapter.
_: type[StageAdapter[PromptInput, NoStream, PromptState, NoStream, PromptEmbeddings]] = (
    WanPromptAdapter
)
