"""Tokenizer stage: prompt text (and, for image edit, the input image) -> text-encoder embeddings.

`PromptAdapterBase` is the stage's step machine, the same for every model family: the cheap
checks, the token count on the engine thread, one encoding step, the result. Each family's
adapter adds only its model: `qwen_image_adapter.PromptEncoderAdapter` (Qwen-Image),
`qwen_image_edit_adapter.EditPromptAdapter` (Qwen-Image-Edit: the prompt read together with the
image) and `wan_adapter.WanPromptAdapter` (Wan: UMT5). `families.adapter_for` picks one by the
folder's `model_index.json`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import assert_never

import numpy as np
import numpy.typing as npt
import PIL.Image
import torch
from tokenizers import Tokenizer
from transformers import (
    PreTrainedTokenizerBase,
)

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.options import capped_option
from stagemesh.shared.devices import CpuDtype, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StepOutput,
)

#: QwenImagePipeline's default `max_sequence_length`: the stage's limit unless configured.
DEFAULT_MAX_SEQUENCE_LENGTH = 512
DEFAULT_MAX_PROMPT_CHARS = 2000
#: Largest input image (height x width), the default and the most an operator may allow: a
#: 16-megapixel photo, which as uint8 RGB (48 MiB) still fits one stage message
#: (shared.limits.MAX_STAGE_MESSAGE_BYTES) beside its prompts. Edit models resize every image
#: to about one megapixel first, so a larger one would buy nothing.
MAX_IMAGE_PIXELS = 4096 * 4096
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

#: An input image as the client sent it: uint8 RGB [height, width, 3].
RgbArray = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class TokenizerLimits:
    """What the stage accepts (its Describe facts): options, tightened to the model's caps."""

    max_prompt_chars: int  # per prompt and per negative prompt
    max_sequence_length: int  # prompt tokens kept; longer prompts are refused
    max_images: int = 0  # images one request may carry (0: the model reads text only)
    max_image_pixels: int = 0  # height x width of one image (0 when max_images is 0)

    @classmethod
    def from_options(
        cls,
        max_prompt_chars: int,
        max_sequence_length: int,
        model_max_tokens: int,
        *,
        max_images: int = 0,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ) -> TokenizerLimits:
        """The limits an operator's options give, each capped by the model (or the wire);
        `max_image_pixels` counts only where the model reads images (max_images > 0)."""
        return cls(
            max_prompt_chars=capped_option("max_prompt_chars", max_prompt_chars),
            max_sequence_length=capped_option(
                "max_sequence_length", max_sequence_length, model_max_tokens
            ),
            max_images=max_images,
            max_image_pixels=(
                capped_option("max_image_pixels", max_image_pixels, MAX_IMAGE_PIXELS)
                if max_images else 0
            ),
        )


@dataclass(frozen=True)
class PromptInput:
    """One prompt to encode. A negative prompt (even "") is what enables true CFG downstream.

    max_sequence_length None = the stage's limit. images: what the text encoder reads with the
    prompt (image edit), uint8 RGB [H, W, 3] each, not resized yet.
    """

    prompt: str
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    images: tuple[RgbArray, ...] = ()


@dataclass
class PromptState:
    request: PromptInput
    max_sequence_length: int
    #: The input images, resized as the model's pipeline resizes them (in `prepare`).
    images: tuple[PIL.Image.Image, ...] = field(default=(), repr=False)
    result: PromptEmbeddings | None = None


class TokenCounter:
    """Counts a text's tokens (special tokens included, as the tokenizer's own call does) with
    a fast tokenizer's Rust tokenizer, padding and truncation off.

    Those two settings are state of the Rust tokenizer that the batch encoder sets before every
    call (transformers compares and sets them each time), so counting switches them off before
    each count and leaves them so. That is safe because counting (`prepare`) and encoding
    (`step`) both run on the engine thread, one after the other. (The counter used to keep its
    own copy of the Rust tokenizer: ~0.6 s of every start for Qwen's vocabulary.)
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer: Tokenizer = tokenizer.backend_tokenizer

    def count(self, text: str) -> int:
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        return len(self._tokenizer.encode(text).ids)


class PromptAdapterBase(abc.ABC):
    """The Tokenizer stage's step machine; a subclass brings one model family's encoder.

    A subclass sets `limits` and `placement` and implements `prompt_token_count` and
    `_encode_batch`; a family that reads images also overrides `_condition_images`. Its
    constructor takes the model folder, the options (`families.TokenizerOptions`) and
    `placement`: where the text encoder computes, and in what dtype (the embeddings leave in
    that dtype).
    """

    stage = "tokenizer"
    limits: TokenizerLimits
    placement: Placement

    @property
    @abc.abstractmethod
    def text_encoder(self) -> torch.nn.Module:
        """The model that encodes prompts (what the `quantization` option quantizes)."""

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: PromptInput) -> None:
        """The cheap checks, on the caller's (event loop) thread: lengths in characters, the
        sequence length asked for, the images' count and shapes. Tokens are counted and images
        resized in `prepare`, on the engine thread."""
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
        self._check_images(payload.images)

    @staticmethod
    def _texts(payload: PromptInput) -> list[tuple[str, str]]:
        texts = [("prompt", payload.prompt)]
        if payload.negative_prompt is not None:
            texts.append(("negative_prompt", payload.negative_prompt))
        return texts

    @abc.abstractmethod
    def prompt_token_count(self, text: str) -> int:
        """Tokens of `text` that count against max_sequence_length."""

    def _sequence_length(self, payload: PromptInput) -> int:
        requested = payload.max_sequence_length
        return self.limits.max_sequence_length if requested is None else requested

    def _check_chars(self, field_name: str, text: str) -> None:
        max_chars = self.limits.max_prompt_chars
        if len(text) > max_chars:  # checked before any tokenizing: it bounds that work
            raise InvalidInputError(
                field_name, f"{field_name} is longer than {max_chars} characters"
            )

    def _check_images(self, images: Sequence[RgbArray]) -> None:
        """Count, dtype, shape and size of the input images (no pixel is read)."""
        max_images = self.limits.max_images
        if max_images == 0 and images:
            raise InvalidInputError("images", "this model reads text only; it takes no images")
        if len(images) > max_images:
            raise InvalidInputError(
                "images", f"at most {max_images} image(s) per request, got {len(images)}"
            )
        for index, image in enumerate(images):
            check_rgb_image(image, self.limits.max_image_pixels, f"images[{index}]")

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
        """Counts the prompts' tokens and resizes the images (CPU work: here, on the engine
        thread, never on the event loop; check_inputs has bounded both) and refuses a prompt
        that is too long (InvalidInputError: the request fails naming the field)."""
        payload = request.payload
        length = self._sequence_length(payload)
        for field_name, text in self._texts(payload):
            self._check_tokens(field_name, text, length)
        return PromptState(
            request=payload, max_sequence_length=length, images=self._condition_images(payload)
        )

    def _condition_images(self, payload: PromptInput) -> tuple[PIL.Image.Image, ...]:
        """The images the encoder reads, resized as the family's pipeline resizes them."""
        return ()  # text-only families: check_inputs has refused any image

    def add_input(self, state: PromptState, payload: NoStream) -> None:
        assert_never(payload)  # the tokenizer stage takes no streamed input

    def step(self, states: Sequence[PromptState]) -> list[StepOutput[NoStream]]:
        results = self._encode_batch(states)  # all or nothing: no state changes before it returns
        for state, result in zip(states, results, strict=True):
            state.result = result
        return [StepOutput(step_index=1, finished=True) for _ in states]

    @abc.abstractmethod
    def _encode_batch(self, states: Sequence[PromptState]) -> list[PromptEmbeddings]:
        """Each state's embeddings, on the CPU (the copy off an accelerator happens here, on
        the compute thread, not where they are sent); must not touch the states."""

    def finish(self, state: PromptState) -> PromptEmbeddings:
        if state.result is None:
            raise RuntimeError("finish() before the encoding step ran")
        return state.result

    def release(self, state: PromptState) -> None:
        state.result = None
        state.images = ()

    def batch_key(self, state: PromptState) -> Hashable:
        return None  # any prompts share a step unless a family says otherwise


def encode_distinct(
    texts: list[str], encode: Callable[[list[str]], list[torch.Tensor]]
) -> list[torch.Tensor]:
    """`encode` (one forward, a row per text) over the distinct texts only, a row per text.

    A burst's shared negative prompt (most often "") or one prompt asked for several images
    costs one row of the forward, not one per request. A text's row does not depend on its
    batch mates (see the module docstring), so a repeat gets what it would have got with a row
    of its own; repeats share that (read-only) tensor.
    """
    distinct = list(dict.fromkeys(texts))
    rows = dict(zip(distinct, encode(distinct), strict=True))
    return [rows[text] for text in texts]


def check_rgb_image(image: RgbArray, max_pixels: int, field_name: str) -> None:
    """An input image must be uint8 RGB [height, width, 3], 1..max_pixels pixels."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise InvalidInputError(
            "images", f"{field_name} must be uint8 RGB [height, width, 3], got "
            f"{image.dtype} {list(image.shape)}"
        )
    height, width = int(image.shape[0]), int(image.shape[1])
    if height < 1 or width < 1:
        raise InvalidInputError("images", f"{field_name} is empty ({height}x{width})")
    if height * width > max_pixels:
        raise InvalidInputError(
            "images",
            f"{field_name} is {width}x{height} = {height * width} pixels; "
            f"the limit is {max_pixels}",
        )
