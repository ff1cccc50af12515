"""Tokenizer stage for Qwen-Image: prompt text -> text-encoder embeddings.

Loads the `tokenizer` and `text_encoder` components of a diffusers Qwen-Image folder and produces
exactly what `QwenImagePipeline.encode_prompt` produces for each request alone, in a single engine
step.

Batching: one step encodes every prompt and negative prompt of its batch in one text-encoder
forward (the pipeline's own encode_prompt over a list: template, right padding to the longest,
system-prefix drop), then hands each request its own rows cut to their valid length, which is
what the request encoded alone gets (one prompt alone needs no mask: the pipeline drops an
all-ones mask to None). Right padding keeps every valid token at the position it has alone, and
the causal text encoder never lets a valid token see the padding after it.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from stagemesh.models.families.qwen_image import PROMPT_MAX_TOKENS, PromptEmbeddings
from stagemesh.models.options import capped_option
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)

#: QwenImagePipeline's default `max_sequence_length`: the stage's limit unless configured.
DEFAULT_MAX_SEQUENCE_LENGTH = 512
DEFAULT_MAX_PROMPT_CHARS = 2000
#: Requests that hold state, and so share one encoding step, unless the engine is told
#: otherwise: a burst of prompts is encoded in one forward, so the DiT gets them in one tick.
DEFAULT_MAX_RUNNING = 8
#: The stage's default dtype on a CPU (`stagemesh.shared.devices.CpuDtype`), from `stagemesh
#: bench dtypes` (1 thread, 20 rounds interleaved) on a prompt + an empty negative prompt with
#: tiny-shapes' text encoder; best float32 / best bfloat16, median per-round bf16 speed-up:
#: Xeon with AMX-BF16 5.6 / 10.7 ms, 0.86x (again 13.5 / 16.6 ms, 0.77x) -> float32;
#: the same CPU held to AVX2 (no bfloat16 instructions) 5.2 / 8.3 ms, 0.69x -> float32.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class TokenizerLimits:
    """What the stage accepts (its Describe facts): options, tightened to the model's caps."""

    max_prompt_chars: int  # per prompt and per negative prompt
    max_sequence_length: int  # prompt tokens kept; longer prompts are refused


@dataclass(frozen=True)
class PromptInput:
    """One prompt to encode. A negative prompt (even "") is what enables true CFG downstream.

    max_sequence_length None = the stage's limit.
    """

    prompt: str
    negative_prompt: str | None = None
    max_sequence_length: int | None = None


@dataclass
class PromptState:
    request: PromptInput
    max_sequence_length: int
    result: PromptEmbeddings | None = None


class PromptEncoderAdapter:
    """The Tokenizer stage's model: Qwen-Image's tokenizer + Qwen2.5-VL text encoder."""

    stage = "tokenizer"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
        placement: Placement = CPU_FLOAT32,
    ) -> None:
        """placement: where the text encoder computes, and in what dtype (the embeddings
        leave in that dtype)."""
        tokenizer = Qwen2Tokenizer.from_pretrained(
            model_dir, subfolder="tokenizer", local_files_only=True
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir,
            subfolder="text_encoder",
            local_files_only=True,
            dtype=placement.dtype,
            device_map=placement.device_name,
        )  # from_pretrained leaves it in eval mode
        self.placement = placement
        self._device = placement.device
        # A text-only pipeline: its own encode_prompt (template, system-prefix drop, padding and
        # mask rules) makes the embeddings the pipeline's by construction. diffusers types every
        # component as required, but a pipeline may leave components out (None).
        self._pipeline = QwenImagePipeline(
            scheduler=None,  # type: ignore[arg-type]
            vae=None,  # type: ignore[arg-type]
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=None,  # type: ignore[arg-type]
        )
        # Batched rows keep their tokens' positions (see the module docstring); the pipeline
        # pads on the tokenizer's side.
        tokenizer.padding_side = "right"
        # Counting tokens must not touch the batch encoder's padding settings (a Rust
        # tokenizer's are shared state), so the count has its own tokenizer.
        self._tokenizer = copy.deepcopy(tokenizer)
        self._template: str = self._pipeline.prompt_template_encode
        self._template_start: int = self._pipeline.prompt_template_encode_start_idx
        self.limits = TokenizerLimits(
            max_prompt_chars=capped_option("max_prompt_chars", max_prompt_chars),
            max_sequence_length=capped_option(
                "max_sequence_length", max_sequence_length, PROMPT_MAX_TOKENS
            ),
        )

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: PromptInput) -> None:
        """The cheap checks, on the caller's (event loop) thread: lengths in characters and the
        sequence length asked for. Tokens are counted in `prepare`, on the engine thread."""
        limit = self.limits.max_sequence_length
        length = self._sequence_length(payload)
        if not 1 <= length <= limit:
            raise InvalidInputError(
                "max_sequence_length", f"max_sequence_length must be in [1, {limit}], got {length}"
            )
        if not payload.prompt.strip():
            raise InvalidInputError("prompt", "prompt must not be empty")
        for field_name, text in self._texts(payload):
            self._check_chars(field_name, text)

    @staticmethod
    def _texts(payload: PromptInput) -> list[tuple[str, str]]:
        texts = [("prompt", payload.prompt)]
        if payload.negative_prompt is not None:
            texts.append(("negative_prompt", payload.negative_prompt))
        return texts

    def prompt_token_count(self, text: str) -> int:
        """Tokens the text encoder keeps for `text` (the template's suffix included)."""
        n_ids = len(self._tokenizer(self._template.format(text)).input_ids)
        return n_ids - self._template_start

    def _sequence_length(self, payload: PromptInput) -> int:
        requested = payload.max_sequence_length
        return self.limits.max_sequence_length if requested is None else requested

    def _check_chars(self, field_name: str, text: str) -> None:
        max_chars = self.limits.max_prompt_chars
        if len(text) > max_chars:  # checked before any tokenizing: it bounds that work
            raise InvalidInputError(
                field_name, f"{field_name} is longer than {max_chars} characters"
            )

    def _check_tokens(self, field_name: str, text: str, max_sequence_length: int) -> None:
        # The pipeline would silently cut the embeddings; the mesh refuses instead.
        n_tokens = self.prompt_token_count(text)
        if n_tokens > max_sequence_length:
            raise InvalidInputError(
                field_name,
                f"{field_name} is {n_tokens} tokens long; the limit is {max_sequence_length}",
            )

    # -- step machine -------------------------------------------------------------------------

    def prepare(self, request: EngineRequest[PromptInput]) -> PromptState:
        """Counts the prompts' tokens (CPU work: here, on the engine thread, never on the
        event loop; check_inputs has bounded the text) and refuses a prompt that is too long
        (InvalidInputError: the request fails naming the field)."""
        payload = request.payload
        length = self._sequence_length(payload)
        for field_name, text in self._texts(payload):
            self._check_tokens(field_name, text, length)
        return PromptState(request=payload, max_sequence_length=length)

    def add_input(self, state: PromptState, payload: NoStream) -> None:
        assert_never(payload)  # the tokenizer stage takes no streamed input

    def step(self, states: Sequence[PromptState]) -> list[StepOutput[NoStream]]:
        results = self._encode_batch(states)  # all or nothing: no state changes before it returns
        for state, result in zip(states, results, strict=True):
            state.result = result
        return [StepOutput(step_index=1, finished=True) for _ in states]

    def finish(self, state: PromptState) -> PromptEmbeddings:
        if state.result is None:
            raise RuntimeError("finish() before the encoding step ran")
        return state.result

    def release(self, state: PromptState) -> None:
        state.result = None

    def batch_key(self, state: PromptState) -> Hashable:
        return None  # any prompts share a step: one forward, padded to the longest

    # -- phases -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _encode_batch(self, states: Sequence[PromptState]) -> list[PromptEmbeddings]:
        """Each state's embeddings, handed over on the CPU (in the encoder's dtype): the copy
        off an accelerator happens here, on the compute thread, not where they are sent."""
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


#: The static proof that the adapter is the Tokenizer stage's StageAdapter.
_: type[StageAdapter[PromptInput, NoStream, PromptState, NoStream, PromptEmbeddings]] = (
    PromptEncoderAdapter
)
