"""Talker stage: text -> codec frames with Sesame CSM (`CsmForConditionalGeneration`).

CSM is a Llama backbone that predicts the first codebook of each audio frame, plus a small depth
decoder that predicts the remaining codebooks from the backbone's last hidden state; the frames
are Mimi codec codes. One engine step emits exactly one frame (all codebooks) per request, so a
cancel stops generation at the next frame boundary.

Batching: every request keeps its own backbone KV cache (prefilled in `prepare`). A step feeds
all requests' previous frames through the backbone in one forward (caches left-padded into a
temporary batch cache, padding masked, each row at its own position), then runs one batched
depth-decoder pass (num_codebooks - 1 forwards for the whole batch; its cache starts empty on
every frame, so rows line up). Sampling uses one `torch.Generator` per request, so a request's
frames do not depend on which requests share its steps.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import secrets
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import AutoTokenizer, CsmForConditionalGeneration, DynamicCache

from stagemesh.models.speech import (
    AUDIO_EOS_TOKEN,
    AUDIO_TOKEN,
    SEGMENT_END,
    SEGMENT_START,
    load_voices,
)
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StepOutput,
)

logger = logging.getLogger(__name__)

#: OpenAI's speech API limit on `input`.
MAX_INPUT_CHARS = 4096
MAX_REF_TEXT_CHARS = 4096
DEFAULT_MAX_NEW_FRAMES = 250  # 20 s at 12.5 Hz
#: The voice name that means "clone the reference audio in `context`".
CLONE_VOICE = "clone"
#: Request field that limits generated frames (each frame is one talker token step).
MAX_NEW_FIELD = "max_new_tokens"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for both the backbone and the depth decoder. temperature 0 = greedy."""

    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 50  # 0 = no top-k filtering
    seed: int | None = None  # None = a fresh random seed per request


@dataclass(frozen=True)
class VoiceContext:
    """A reference clip for voice cloning: its codec frames and its transcript."""

    codes: torch.Tensor  # [n, num_codebooks] int64, from the Codec stage's encode
    text: str = ""


@dataclass(frozen=True)
class TalkerInput:
    """One utterance to speak.

    Exactly one of `text` and `token_ids` (the text's ids from the Tokenizer stage, without
    CSM's segment markup, which the talker adds). The voice is a name from the model's voices,
    or "clone" (or None) with `context`; `speaker_id` overrides the voice's id.
    """

    text: str | None = None
    token_ids: Sequence[int] | None = None
    voice: str | None = None
    speaker_id: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_frames: int = DEFAULT_MAX_NEW_FRAMES
    stop_on_end_of_audio: bool = True
    context: VoiceContext | None = None


class FinishReason(enum.Enum):
    STOP = "stop"  # CSM's end-of-audio frame
    LENGTH = "length"  # max_new_frames reached


@dataclass(frozen=True)
class TalkerResult:
    frames: torch.Tensor  # [n, num_codebooks] int64, every frame streamed, no end-of-audio frame
    finish_reason: FinishReason


@dataclass
class TalkerState:
    """One request in flight. `cache`, `logits` and `hidden` are None once released."""

    request_id: str
    sampling: SamplingParams
    max_new_frames: int
    stop_on_end_of_audio: bool
    generator: torch.Generator
    cache: DynamicCache | None
    logits: torch.Tensor | None  # [vocab] first-codebook logits for the next frame
    hidden: torch.Tensor | None  # [hidden] backbone state that seeds the depth decoder
    pending_frame: torch.Tensor | None = None  # last frame, not yet fed to the backbone
    frames: list[torch.Tensor] = field(default_factory=list)
    steps: int = 0
    finish_reason: FinishReason | None = None


class TalkerAdapter:
    """`StageAdapter[TalkerState]` over a CSM folder (see `stagemesh.models.speech`)."""

    stage = "talker"

    def __init__(self, model_dir: str | Path) -> None:
        self._model = CsmForConditionalGeneration.from_pretrained(
            model_dir, local_files_only=True
        ).eval()
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self._voices = load_voices(model_dir)
        config = self._model.config
        self._num_codebooks: int = config.num_codebooks
        self._eos_code: int = config.codebook_eos_token_id
        # CSM's codebook vocabulary has a few ids past the codec's codebook; they are never
        # valid audio, so sampling is restricted to ids the codec can decode.
        self._codec_vocab: int = config.codec_config.codebook_size
        self._max_positions: int = config.max_position_embeddings
        self._text_vocab: int = config.text_vocab_size
        self._ids = {
            tok: self._tokenizer.convert_tokens_to_ids(tok)
            for tok in (SEGMENT_END, AUDIO_TOKEN, AUDIO_EOS_TOKEN)
        }

    @property
    def voices(self) -> dict[str, int]:
        return dict(self._voices)

    @property
    def num_codebooks(self) -> int:
        return self._num_codebooks

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: Any) -> None:
        if not isinstance(payload, TalkerInput):
            raise TypeError(f"expected TalkerInput, got {type(payload).__name__}")
        text_ids = self._check_text(payload)
        self._resolve_speaker(payload)
        self._check_sampling(payload.sampling)
        ref_len = self._check_context(payload.context)
        if not 1 <= payload.max_new_frames <= self._max_positions:
            raise InvalidInputError(
                MAX_NEW_FIELD,
                f"{MAX_NEW_FIELD} must be in [1, {self._max_positions}], "
                f"got {payload.max_new_frames}",
            )
        prompt_len = len(self._segment_ids(0, text_ids)) + ref_len
        if prompt_len >= self._max_positions:
            raise InvalidInputError(
                "input",
                f"input is too long: {prompt_len} prompt positions, "
                f"the model has {self._max_positions}",
            )
        if prompt_len + payload.max_new_frames > self._max_positions:
            raise InvalidInputError(
                MAX_NEW_FIELD,
                f"{MAX_NEW_FIELD}={payload.max_new_frames} does not fit after a prompt of "
                f"{prompt_len} positions (model maximum {self._max_positions})",
            )

    def _check_text(self, payload: TalkerInput) -> list[int]:
        if payload.text is not None and payload.token_ids is not None:
            raise InvalidInputError("input", "give either text or token_ids, not both")
        if payload.token_ids is not None:
            ids = [int(i) for i in payload.token_ids]
            if not ids:
                raise InvalidInputError("input", "input is empty")
            if not all(0 <= i < self._text_vocab for i in ids):
                raise InvalidInputError("input", f"token ids must be in [0, {self._text_vocab})")
            return ids
        text = (payload.text or "").strip()
        if not text:
            raise InvalidInputError("input", "input is empty")
        if len(text) > MAX_INPUT_CHARS:
            raise InvalidInputError(
                "input", f"input has {len(text)} characters, the limit is {MAX_INPUT_CHARS}"
            )
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _resolve_speaker(self, payload: TalkerInput) -> int:
        if payload.speaker_id is not None:
            if payload.speaker_id < 0:
                raise InvalidInputError(
                    "voice", f"speaker id must be >= 0, got {payload.speaker_id}"
                )
            return payload.speaker_id
        voice = (payload.voice or "").lower()
        if voice in ("", CLONE_VOICE) and payload.context is not None:
            return 0
        if voice == CLONE_VOICE:
            raise InvalidInputError("ref_audio", "voice 'clone' needs reference audio")
        if not voice:
            return next(iter(self._voices.values()))
        if voice not in self._voices:
            raise InvalidInputError(
                "voice", f"unknown voice {payload.voice!r}; known: {sorted(self._voices)}"
            )
        return self._voices[voice]

    @staticmethod
    def _check_sampling(sampling: SamplingParams) -> None:
        if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
            raise InvalidInputError(
                "temperature", f"temperature must be >= 0, got {sampling.temperature}"
            )
        if not 0 < sampling.top_p <= 1:
            raise InvalidInputError("top_p", f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.top_k < 0:
            raise InvalidInputError("top_k", f"top_k must be >= 0, got {sampling.top_k}")
        if sampling.seed is not None and not 0 <= sampling.seed < 2**63:
            raise InvalidInputError("seed", f"seed must be in [0, 2**63), got {sampling.seed}")

    def _check_context(self, context: VoiceContext | None) -> int:
        """Validate reference codes; return how many prompt positions they take."""
        if context is None:
            return 0
        codes = context.codes
        if (
            codes.ndim != 2
            or codes.shape[1] != self._num_codebooks
            or codes.shape[0] == 0
            or codes.dtype.is_floating_point
        ):
            raise InvalidInputError(
                "ref_audio",
                f"reference codes must be integer [frames, {self._num_codebooks}], "
                f"got {codes.dtype} {tuple(codes.shape)}",
            )
        if int(codes.min()) < 0 or int(codes.max()) >= self._codec_vocab:
            raise InvalidInputError(
                "ref_audio", f"reference codes must be in [0, {self._codec_vocab})"
            )
        if len(context.text) > MAX_REF_TEXT_CHARS:
            raise InvalidInputError(
                "ref_text",
                f"ref_text has {len(context.text)} characters, the limit is {MAX_REF_TEXT_CHARS}",
            )
        ref_text_ids = self._tokenizer.encode(context.text, add_special_tokens=False)
        # segment markup + text + one position per frame + the audio-eos frame
        return len(self._segment_ids(0, ref_text_ids)) + codes.shape[0] + 1

    # -- prompt -------------------------------------------------------------------------------

    def _segment_ids(self, speaker: int, text_ids: Sequence[int]) -> list[int]:
        """CSM's text segment `<bos>[speaker]text<eos>` as ids."""
        head = self._tokenizer.encode(f"{SEGMENT_START}[{speaker}]", add_special_tokens=False)
        return [*head, *text_ids, self._ids[SEGMENT_END]]

    def _prompt_embeds(self, payload: TalkerInput, speaker: int) -> torch.Tensor:
        """[1, positions, hidden]: an optional reference segment (text, then its audio frames
        and the end-of-audio frame, as CSM's processor lays them out), then the target text."""
        text_ids = self._check_text(payload)
        model = self._model
        context = payload.context
        ids: list[int] = []
        if context is not None:
            ref_ids = self._tokenizer.encode(context.text, add_special_tokens=False)
            ids += self._segment_ids(speaker, ref_ids)
            ids += [self._ids[AUDIO_TOKEN]] * context.codes.shape[0] + [self._ids[AUDIO_EOS_TOKEN]]
        ids += self._segment_ids(speaker, text_ids)
        input_ids = torch.tensor([ids], device=model.device)
        embeds = model.embed_text_tokens(input_ids)
        if context is not None:
            codes = context.codes.to(device=model.device, dtype=torch.long)
            eos_frame = torch.full((1, self._num_codebooks), self._eos_code, device=model.device)
            audio = model.backbone_model.embed_tokens(torch.cat([codes, eos_frame])[None])
            is_audio = (input_ids == self._ids[AUDIO_TOKEN]) | (
                input_ids == self._ids[AUDIO_EOS_TOKEN]
            )
            embeds[is_audio] = audio[0].to(embeds.dtype)
        return embeds

    # -- engine contract ----------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, request: EngineRequest) -> TalkerState:
        payload: TalkerInput = request.payload
        speaker = self._resolve_speaker(payload)
        seed = payload.sampling.seed if payload.sampling.seed is not None else secrets.randbits(63)
        cache = DynamicCache(config=self._model.config)
        state = TalkerState(
            request_id=request.request_id,
            sampling=payload.sampling,
            max_new_frames=payload.max_new_frames,
            stop_on_end_of_audio=payload.stop_on_end_of_audio,
            generator=torch.Generator(device=self._model.device).manual_seed(seed),
            cache=cache,
            logits=None,
            hidden=None,
        )
        self._backbone_forward(state, inputs_embeds=self._prompt_embeds(payload, speaker))
        return state

    def add_input(self, state: TalkerState, payload: Any) -> None:
        raise InvalidInputError("input", "the talker does not accept streamed input")

    @torch.inference_mode()
    def step(self, states: Sequence[TalkerState]) -> list[StepOutput]:
        self._feed_pending_frames([s for s in states if s.pending_frame is not None])
        frames = self._next_frames(states)
        return [self._advance(state, frame) for state, frame in zip(states, frames, strict=True)]

    def finish(self, state: TalkerState) -> TalkerResult:
        frames = (
            torch.stack(state.frames)
            if state.frames
            else torch.empty((0, self._num_codebooks), dtype=torch.long)
        )
        return TalkerResult(frames=frames, finish_reason=state.finish_reason or FinishReason.LENGTH)

    def release(self, state: TalkerState) -> None:
        state.cache = None
        state.logits = None
        state.hidden = None
        state.pending_frame = None
        state.frames = []

    def batch_key(self, state: TalkerState) -> Hashable:
        return self.stage

    # -- one frame ----------------------------------------------------------------------------

    def _backbone_forward(self, state: TalkerState, **inputs: torch.Tensor) -> None:
        cache = self._live_cache(state)
        out = self._model(**inputs, cache=cache, use_cache=True, output_hidden_states=True)
        self._take_outputs(state, out, row=0)

    def _take_outputs(self, state: TalkerState, out: Any, row: int) -> None:
        state.logits = out.logits[row, -1]
        # The same hidden state `CsmForConditionalGeneration.generate` hands the depth decoder.
        state.hidden = out.hidden_states[-1][row, -1]
        state.pending_frame = None

    @staticmethod
    def _live_cache(state: TalkerState) -> DynamicCache:
        if state.cache is None:
            raise RuntimeError(f"request {state.request_id} was released")
        return state.cache

    def _feed_pending_frames(self, states: Sequence[TalkerState]) -> None:
        """One backbone forward for every state's last frame, batched over the states.

        The per-request caches have different lengths, so they are left-padded into one
        temporary batch cache with an attention mask that hides the padding, and each row
        gets its true position. Afterwards each request's cache is extended by its own new
        key/value entry only, so requests stay independent of their batch mates.
        """
        if len(states) <= 1:
            for state in states:
                assert state.pending_frame is not None
                self._backbone_forward(state, input_ids=state.pending_frame.view(1, 1, -1))
            return
        caches = [self._live_cache(s) for s in states]
        lengths = [cache.get_seq_length() for cache in caches]
        longest = max(lengths)
        batch = self._padded_batch_cache(caches, longest)
        mask = torch.zeros((len(states), longest + 1), dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, longest - length :] = 1
        device = self._model.device
        out = self._model(
            input_ids=torch.stack([s.pending_frame for s in states])[:, None, :],
            attention_mask=mask.to(device),
            position_ids=torch.tensor(lengths, device=device)[:, None],
            cache=batch,
            use_cache=True,
            output_hidden_states=True,
        )
        for row, (state, cache) in enumerate(zip(states, caches, strict=True)):
            for layer, batch_layer in enumerate(batch.layers):
                new_keys = batch_layer.keys[row : row + 1, :, -1:]
                new_values = batch_layer.values[row : row + 1, :, -1:]
                cache.update(new_keys, new_values, layer)
            self._take_outputs(state, out, row)

    def _padded_batch_cache(self, caches: Sequence[DynamicCache], longest: int) -> DynamicCache:
        """The requests' caches stacked into one, each left-padded with zeros to `longest`."""
        batch = DynamicCache(config=self._model.config)
        for layer in range(len(caches[0].layers)):
            keys = [_left_pad(c.layers[layer].keys, longest) for c in caches]
            values = [_left_pad(c.layers[layer].values, longest) for c in caches]
            batch.update(torch.cat(keys), torch.cat(values), layer)
        return batch

    def _next_frames(self, states: Sequence[TalkerState]) -> torch.Tensor:
        """[batch, num_codebooks]: the backbone's codebook 0, then the depth decoder's rest."""
        first = torch.stack([self._sample(s.logits, s) for s in states])
        hidden = torch.stack([s.hidden for s in states])
        depth = self._model.depth_decoder
        cache = DynamicCache(config=depth.config)
        # position 0 is a placeholder the depth decoder replaces with the backbone state
        input_ids = torch.stack([torch.zeros_like(first), first], dim=1)
        codes = [first]
        out = depth(
            input_ids=input_ids,
            backbone_last_hidden_state=hidden,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for codebook in range(1, self._num_codebooks):
            logits = out.logits[:, -1]
            code = torch.stack([self._sample(logits[i], s) for i, s in enumerate(states)])
            codes.append(code)
            if codebook < self._num_codebooks - 1:
                out = depth(input_ids=code[:, None], cache=cache, use_cache=True, logits_to_keep=1)
        return torch.stack(codes, dim=1)

    def _sample(self, logits: torch.Tensor | None, state: TalkerState) -> torch.Tensor:
        if logits is None:
            raise RuntimeError(f"request {state.request_id} was released")
        params = state.sampling
        scores = logits[: self._codec_vocab].float()
        if params.temperature == 0:
            return scores.argmax()
        scores = scores / params.temperature
        if 0 < params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if params.top_p < 1:
            scores = _top_p_filter(scores, params.top_p)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=state.generator)[0]

    def _advance(self, state: TalkerState, frame: torch.Tensor) -> StepOutput:
        state.steps += 1
        if state.stop_on_end_of_audio and bool((frame == self._eos_code).all()):
            state.finish_reason = FinishReason.STOP
            return StepOutput(step_index=state.steps, finished=True)
        frame = frame.to(dtype=torch.long, device="cpu")
        state.frames.append(frame)
        state.pending_frame = frame.to(self._model.device)
        finished = len(state.frames) >= state.max_new_frames
        if finished:
            state.finish_reason = FinishReason.LENGTH
        return StepOutput(step_index=state.steps, partial=frame, finished=finished)


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of ids whose probability reaches top_p (always at least one)."""
    sorted_scores, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


def _left_pad(entries: torch.Tensor, length: int) -> torch.Tensor:
    """[batch, heads, seq, dim] -> [batch, heads, length, dim], zeros in front."""
    return torch.nn.functional.pad(entries, (0, 0, length - entries.shape[-2], 0))
