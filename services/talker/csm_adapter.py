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

A step is all or nothing (the engine's failure isolation re-runs the members of a batch that
raised one by one): the forwards extend copies of the caches that share their tensors, the
generators' states are restored if anything raises, and a state takes its new cache, logits,
hidden state and frame only once the whole batch has succeeded.

The prompt markup (segment and audio tokens) and the voices come from the model folder
(`stagemesh.models.families.csm`), so a real CSM folder and the tiny built one take one path.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
import os
import secrets
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import assert_never

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import CsmForConditionalGeneration, DynamicCache
from transformers.models.csm.modeling_csm import CsmOutputWithPast

from stagemesh.models.families.csm import CsmFacts, CsmPromptFormat, load_voices
from stagemesh.models.options import capped_option
from stagemesh.services.kv_batching import (
    layer_kv,
    left_padded_cache,
    live,
    nucleus,
    padding_mask,
)
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)
from stagemesh.shared.limits import CLONE_VOICE, DEFAULT_VOICE, MAX_SEED

logger = logging.getLogger(__name__)

#: Option defaults: OpenAI's speech API limit on `input`; 60 s of audio at 12.5 Hz.
DEFAULT_MAX_INPUT_CHARS = 4096
DEFAULT_MAX_NEW_FRAMES_LIMIT = 750
#: Frames generated when a request sets no limit (20 s at 12.5 Hz).
DEFAULT_MAX_NEW_FRAMES = 250
MAX_REF_TEXT_CHARS = 4096
MAX_TEMPERATURE = 10.0
MAX_TOP_K = 10_000
#: Request field that limits generated frames (each frame is one talker token step).
MAX_NEW_FIELD = "max_new_tokens"
#: The stage's default dtype on a CPU (`stagemesh.shared.devices.CpuDtype`), from `stagemesh
#: bench dtypes` (1 thread, 20 rounds interleaved) on prefill + 20 frames with csm-tiny;
#: best float32 / best bfloat16, median per-round bf16 speed-up:
#: Xeon with AMX-BF16 246.5 / 263.1 ms, 0.96x (again 244.4 / 251.0 ms, 0.97x) -> float32;
#: the same CPU held to AVX2 (no bfloat16 instructions) 143.3 / 145.8 ms, 0.98x -> float32.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)


@dataclass(frozen=True)
class TalkerLimits:
    """What the stage accepts (its Describe facts): options, tightened to the model's caps."""

    voices: tuple[str, ...]  # lower case, in the model folder's order
    default_voice: str  # what no voice, "" or "default" selects
    supports_voice_clone: bool
    max_input_chars: int
    max_reference_text_chars: int
    max_new_frames: int  # at most the model's positions
    default_max_new_frames: int  # what a request without its own limit may generate
    frame_rate: float  # frames per second of audio
    max_temperature: float
    max_top_k: int


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
    "default" / "" / None for the stage's default voice, or "clone" with `context`;
    `speaker_id` overrides the voice's id. max_new_frames None = the stage's default.
    """

    text: str | None = None
    token_ids: Sequence[int] | None = None
    voice: str | None = None
    speaker_id: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_frames: int | None = None
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


@dataclass(frozen=True)
class _Head:
    """A request's backbone results after a forward, not yet stored in its state."""

    cache: DynamicCache  # the request's cache extended by the forward's input
    logits: torch.Tensor  # [vocab] first-codebook logits for the next frame
    hidden: torch.Tensor  # [hidden] backbone state that seeds the depth decoder


class TalkerAdapter:
    """The Talker stage's model: a CSM folder (backbone + depth decoder, its voices)."""

    stage = "talker"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
        max_new_frames: int = DEFAULT_MAX_NEW_FRAMES_LIMIT,
        default_voice: str | None = None,
        placement: Placement = CPU_FLOAT32,
    ) -> None:
        """placement: where the backbone and depth decoder compute (KV caches and sampling
        generators live there too), and in what dtype; frames leave as int64 codes."""
        # CSM overrides from_pretrained without annotations; it returns the model in eval mode.
        load = CsmForConditionalGeneration.from_pretrained
        self._model: CsmForConditionalGeneration = load(  # type: ignore[no-untyped-call]
            model_dir,
            local_files_only=True,
            dtype=placement.dtype,
            device_map=placement.device_name,
        )
        self.placement = placement
        self._prompt = CsmPromptFormat.from_folder(model_dir)
        self._voices = load_voices(model_dir)
        self._facts = CsmFacts.of(self._model.config)
        self.limits = self._limits(max_input_chars, max_new_frames, default_voice)

    def _limits(
        self, max_input_chars: int, max_new_frames: int, default_voice: str | None
    ) -> TalkerLimits:
        voices = tuple(self._voices)
        default = voices[0] if default_voice is None else default_voice.lower()
        if default not in self._voices:
            raise ValueError(f"option default_voice={default_voice!r} is not one of {voices}")
        most_frames = capped_option("max_new_frames", max_new_frames, self._facts.max_positions)
        return TalkerLimits(
            voices=voices,
            default_voice=default,
            supports_voice_clone=True,
            max_input_chars=capped_option("max_input_chars", max_input_chars),
            max_reference_text_chars=MAX_REF_TEXT_CHARS,
            max_new_frames=most_frames,
            default_max_new_frames=min(DEFAULT_MAX_NEW_FRAMES, most_frames),
            frame_rate=self._facts.frame_rate,
            max_temperature=MAX_TEMPERATURE,
            max_top_k=MAX_TOP_K,
        )

    @property
    def voices(self) -> dict[str, int]:
        return dict(self._voices)

    @property
    def num_codebooks(self) -> int:
        return self._facts.num_codebooks

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: TalkerInput) -> None:
        text_ids = self._check_text(payload)
        self._resolve_speaker(payload)
        self._check_sampling(payload.sampling)
        ref_len = self._check_context(payload.context)
        max_new_frames = self._max_new_frames(payload)
        limit = self.limits.max_new_frames
        if not 1 <= max_new_frames <= limit:
            raise InvalidInputError(
                MAX_NEW_FIELD, f"{MAX_NEW_FIELD} must be in [1, {limit}], got {max_new_frames}"
            )
        positions = self._facts.max_positions
        prompt_len = len(self._prompt.segment_ids(0, text_ids)) + ref_len
        if prompt_len >= positions:
            raise InvalidInputError(
                "input",
                f"input is too long: {prompt_len} prompt positions, the model has {positions}",
            )
        if prompt_len + max_new_frames > positions:
            raise InvalidInputError(
                MAX_NEW_FIELD,
                f"{MAX_NEW_FIELD}={max_new_frames} does not fit after a prompt of "
                f"{prompt_len} positions (model maximum {positions})",
            )

    def _max_new_frames(self, payload: TalkerInput) -> int:
        requested = payload.max_new_frames
        return self.limits.default_max_new_frames if requested is None else requested

    def _check_text(self, payload: TalkerInput) -> list[int]:
        if payload.text is not None and payload.token_ids is not None:
            raise InvalidInputError("input", "give either text or token_ids, not both")
        if payload.token_ids is not None:
            ids = [int(i) for i in payload.token_ids]
            vocab = self._prompt.text_vocab_size
            if not ids:
                raise InvalidInputError("input", "input is empty")
            if not all(0 <= i < vocab for i in ids):
                raise InvalidInputError("input", f"token ids must be in [0, {vocab})")
            return ids
        text = (payload.text or "").strip()
        max_chars = self.limits.max_input_chars
        if not text:
            raise InvalidInputError("input", "input is empty")
        if len(text) > max_chars:
            raise InvalidInputError(
                "input", f"input has {len(text)} characters, the limit is {max_chars}"
            )
        return self._prompt.encode(text)

    def _resolve_speaker(self, payload: TalkerInput) -> int:
        if payload.speaker_id is not None:
            if payload.speaker_id < 0:
                raise InvalidInputError(
                    "voice", f"speaker id must be >= 0, got {payload.speaker_id}"
                )
            return payload.speaker_id
        voice = (payload.voice or DEFAULT_VOICE).lower()
        if voice == CLONE_VOICE:
            if payload.context is None:
                raise InvalidInputError("ref_audio", "voice 'clone' needs reference audio")
            return 0  # the speaker of the reference segment, which the model continues
        if voice == DEFAULT_VOICE:
            return self._voices[self.limits.default_voice]
        if voice not in self._voices:
            raise InvalidInputError(
                "voice", f"unknown voice {payload.voice!r}; known: {list(self.limits.voices)}"
            )
        return self._voices[voice]

    def _check_sampling(self, sampling: SamplingParams) -> None:
        max_temperature, max_top_k = self.limits.max_temperature, self.limits.max_top_k
        temperature = sampling.temperature
        if not (math.isfinite(temperature) and 0 <= temperature <= max_temperature):
            raise InvalidInputError(
                "temperature", f"temperature must be in [0, {max_temperature}], got {temperature}"
            )
        if not 0 < sampling.top_p <= 1:
            raise InvalidInputError("top_p", f"top_p must be in (0, 1], got {sampling.top_p}")
        if not 0 <= sampling.top_k <= max_top_k:
            raise InvalidInputError(
                "top_k", f"top_k must be in [0, {max_top_k}], got {sampling.top_k}"
            )
        if sampling.seed is not None and not 0 <= sampling.seed <= MAX_SEED:
            raise InvalidInputError("seed", f"seed must be in [0, {MAX_SEED}], got {sampling.seed}")

    def _check_context(self, context: VoiceContext | None) -> int:
        """Validate reference codes; return how many prompt positions they take."""
        if context is None:
            return 0
        codes, num_codebooks, vocab = context.codes, self.num_codebooks, self._facts.codec_vocab
        if (
            codes.ndim != 2
            or codes.shape[1] != num_codebooks
            or codes.shape[0] == 0
            or codes.dtype.is_floating_point
        ):
            raise InvalidInputError(
                "ref_audio",
                f"reference codes must be integer [frames, {num_codebooks}], "
                f"got {codes.dtype} {tuple(codes.shape)}",
            )
        if int(codes.min()) < 0 or int(codes.max()) >= vocab:
            raise InvalidInputError("ref_audio", f"reference codes must be in [0, {vocab})")
        max_chars = self.limits.max_reference_text_chars
        if len(context.text) > max_chars:
            raise InvalidInputError(
                "ref_text",
                f"ref_text has {len(context.text)} characters, the limit is {max_chars}",
            )
        ref_text_ids = self._prompt.encode(context.text)
        # segment markup + text + one position per frame + the audio-eos frame
        return len(self._prompt.segment_ids(0, ref_text_ids)) + codes.shape[0] + 1

    # -- prompt -------------------------------------------------------------------------------

    def _prompt_embeds(self, payload: TalkerInput, speaker: int) -> torch.Tensor:
        """[1, positions, hidden]: an optional reference segment (text, then its audio frames
        and the end-of-audio frame, as CSM's processor lays them out), then the target text."""
        text_ids = self._check_text(payload)
        model, prompt = self._model, self._prompt
        context = payload.context
        ids: list[int] = []
        if context is not None:
            ids += prompt.segment_ids(speaker, prompt.encode(context.text))
            ids += prompt.reference_audio_ids(context.codes.shape[0])
        ids += prompt.segment_ids(speaker, text_ids)
        input_ids = torch.tensor([ids], device=model.device)
        embeds: torch.Tensor = model.embed_text_tokens(input_ids)
        if context is not None:
            codes = context.codes.to(device=model.device, dtype=torch.long)
            eos_frame = torch.full(
                (1, self.num_codebooks), self._facts.end_of_audio_code, device=model.device
            )
            audio: torch.Tensor = model.backbone_model.embed_tokens(
                torch.cat([codes, eos_frame])[None]
            )
            is_audio = (input_ids == prompt.audio_id) | (input_ids == prompt.audio_eos_id)
            embeds[is_audio] = audio[0].to(embeds.dtype)
        return embeds

    # -- engine contract ----------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, request: EngineRequest[TalkerInput]) -> TalkerState:
        payload = request.payload
        speaker = self._resolve_speaker(payload)
        seed = payload.sampling.seed if payload.sampling.seed is not None else secrets.randbits(63)
        cache = DynamicCache(config=self._model.config)
        state = TalkerState(
            request_id=request.request_id,
            sampling=payload.sampling,
            max_new_frames=self._max_new_frames(payload),
            stop_on_end_of_audio=payload.stop_on_end_of_audio,
            generator=torch.Generator(device=self._model.device).manual_seed(seed),
            cache=cache,
            logits=None,
            hidden=None,
        )
        embeds = self._prompt_embeds(payload, speaker)
        _commit(state, self._forward_one(cache, inputs_embeds=embeds))
        return state

    def add_input(self, state: TalkerState, payload: NoStream) -> None:
        assert_never(payload)  # the talker takes its whole text at the start

    @torch.inference_mode()
    def step(self, states: Sequence[TalkerState]) -> list[StepOutput[torch.Tensor]]:
        # All or nothing (see the module docstring): compute into temporaries, rewind the
        # generators if anything raises, store the results once every row has succeeded.
        generator_states = [state.generator.get_state() for state in states]
        try:
            heads = self._feed_pending_frames(states)
            frames = self._next_frames(states, heads)
        except BaseException:
            for state, generator_state in zip(states, generator_states, strict=True):
                state.generator.set_state(generator_state)
            raise
        outputs: list[StepOutput[torch.Tensor]] = []
        for state, head, frame in zip(states, heads, frames, strict=True):
            _commit(state, head)
            outputs.append(self._advance(state, frame))
        return outputs

    def finish(self, state: TalkerState) -> TalkerResult:
        frames = (
            torch.stack(state.frames)
            if state.frames
            else torch.empty((0, self.num_codebooks), dtype=torch.long)
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

    def _forward_one(self, cache: DynamicCache, **inputs: torch.Tensor) -> _Head:
        """One request's backbone forward; `cache` is left as it was (the forward extends a
        copy that shares its tensors)."""
        successor = _sharing_copy(cache)
        out: CsmOutputWithPast = self._model(
            **inputs, cache=successor, use_cache=True, output_hidden_states=True
        )
        return _head(successor, out, row=0)

    @staticmethod
    def _live_cache(state: TalkerState) -> DynamicCache:
        return live(state.cache, state.request_id)

    @staticmethod
    def _pending_frame(state: TalkerState) -> torch.Tensor:
        if state.pending_frame is None:
            raise RuntimeError(f"request {state.request_id} has no frame to feed")
        return state.pending_frame

    def _feed_pending_frames(self, states: Sequence[TalkerState]) -> list[_Head]:
        """Every state's backbone results after its last frame (a state without one keeps
        its current results); no state is changed."""
        pending = [state for state in states if state.pending_frame is not None]
        fed = iter(self._feed(pending))
        return [
            next(fed) if state.pending_frame is not None else _current_head(state)
            for state in states
        ]

    def _feed(self, states: Sequence[TalkerState]) -> list[_Head]:
        """One backbone forward for every state's last frame, batched over the states.

        The per-request caches have different lengths, so they are left-padded into one
        temporary batch cache with an attention mask that hides the padding, and each row
        gets its true position. Each request's new cache is its old one extended by its own
        new key/value entry only, so requests stay independent of their batch mates.
        """
        if len(states) <= 1:
            return [
                self._forward_one(
                    self._live_cache(state), input_ids=self._pending_frame(state).view(1, 1, -1)
                )
                for state in states
            ]
        caches = [self._live_cache(s) for s in states]
        lengths = [cache.get_seq_length() for cache in caches]
        longest = max(lengths)
        batch = left_padded_cache(
            [[layer_kv(layer) for layer in cache.layers] for cache in caches], longest,
            self._model.config)
        mask = padding_mask(lengths, 1)
        device = self._model.device
        out: CsmOutputWithPast = self._model(
            input_ids=torch.stack([self._pending_frame(s) for s in states])[:, None, :],
            attention_mask=mask.to(device),
            position_ids=torch.tensor(lengths, device=device)[:, None],
            cache=batch,
            use_cache=True,
            output_hidden_states=True,
        )
        heads: list[_Head] = []
        for row, cache in enumerate(caches):
            successor = _sharing_copy(cache)
            for layer in range(len(batch.layers)):
                keys, values = layer_kv(batch.layers[layer])
                successor.update(keys[row : row + 1, :, -1:], values[row : row + 1, :, -1:], layer)
            heads.append(_head(successor, out, row))
        return heads

    def _next_frames(self, states: Sequence[TalkerState], heads: Sequence[_Head]) -> torch.Tensor:
        """[batch, num_codebooks]: the backbone's codebook 0, then the depth decoder's rest."""
        pairs = zip(heads, states, strict=True)
        first = torch.stack([self._sample(head.logits, state) for head, state in pairs])
        hidden = torch.stack([head.hidden for head in heads])
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
        for codebook in range(1, self.num_codebooks):
            logits: torch.Tensor = out.logits[:, -1]
            code = torch.stack([self._sample(logits[i], s) for i, s in enumerate(states)])
            codes.append(code)
            if codebook < self.num_codebooks - 1:
                out = depth(input_ids=code[:, None], cache=cache, use_cache=True, logits_to_keep=1)
        return torch.stack(codes, dim=1)

    def _sample(self, logits: torch.Tensor, state: TalkerState) -> torch.Tensor:
        params = state.sampling
        scores = logits[: self._facts.codec_vocab].float()
        if params.temperature == 0:
            return scores.argmax()
        scores = scores / params.temperature
        if 0 < params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if params.top_p < 1:
            scores = scores.masked_fill(~nucleus(scores, params.top_p, logits=True), -math.inf)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=state.generator)[0]

    def _advance(self, state: TalkerState, frame: torch.Tensor) -> StepOutput[torch.Tensor]:
        state.steps += 1
        if state.stop_on_end_of_audio and bool((frame == self._facts.end_of_audio_code).all()):
            state.finish_reason = FinishReason.STOP
            return StepOutput(step_index=state.steps, finished=True)
        frame = frame.to(dtype=torch.long, device="cpu")
        state.frames.append(frame)
        state.pending_frame = frame.to(self._model.device)
        finished = len(state.frames) >= state.max_new_frames
        if finished:
            state.finish_reason = FinishReason.LENGTH
        return StepOutput(step_index=state.steps, partial=frame, finished=finished)


def _head(cache: DynamicCache, out: CsmOutputWithPast, row: int) -> _Head:
    if out.logits is None or out.hidden_states is None:
        raise RuntimeError("the CSM backbone returned no logits or hidden states")
    # The same hidden state `CsmForConditionalGeneration.generate` hands the depth decoder.
    return _Head(cache=cache, logits=out.logits[row, -1], hidden=out.hidden_states[-1][row, -1])


def _current_head(state: TalkerState) -> _Head:
    """A state's stored backbone results (it has no frame to feed)."""
    return _Head(
        cache=TalkerAdapter._live_cache(state),
        logits=live(state.logits, state.request_id),
        hidden=live(state.hidden, state.request_id),
    )


def _commit(state: TalkerState, head: _Head) -> None:
    """Store a forward's results in the state (cannot raise: the step has succeeded)."""
    state.cache, state.logits, state.hidden = head.cache, head.logits, head.hidden
    state.pending_frame = None


def _sharing_copy(cache: DynamicCache) -> DynamicCache:
    """A cache holding the same key/value tensors as `cache`, no data copied. Extending it
    leaves `cache` as it was: `DynamicLayer.update` concatenates into new tensors and rebinds
    the copy's own layer objects."""
    successor = copy.copy(cache)
    successor.layers = [copy.copy(layer) for layer in cache.layers]
    return successor


#: The static proof that the adapter is the Talker stage's StageAdapter.
_: type[StageAdapter[TalkerInput, NoStream, TalkerState, torch.Tensor, TalkerResult]] = (
    TalkerAdapter
)
