"""Thinker stage: a chat conversation -> the assistant's answer, one token per engine step.

The model is a causal LM folder (`AutoModelForCausalLM`, e.g. SmolLM2-135M-Instruct, built by
`stagemesh.models.smollm2`); the prompt is the folder's own chat template. One engine step
writes exactly one token per request, so a cancel stops the answer at the next token boundary.

Batching (continuous, at token granularity): every request keeps its own KV cache, prefilled
alone in `prepare`. A step feeds each request's last token through the model in ONE forward:
the caches, of different lengths, are left-padded into a temporary batch cache, an attention
mask hides the padding and each row gets its own position; afterwards each request keeps its
row of the batch cache (a view: nothing is copied back). A request's tokens therefore do not
depend on its batch mates: under greedy decoding a batched answer equals the solo answer
(tests/model/test_thinker_adapter.py checks it). Rebuilding the padded cache copies every
running request's cache once a step, about what the cache append itself costs; it keeps the
step simple and exactly right while requests join and leave between any two tokens.

Prefix caching (`prefix_cache.py`): a prompt that begins like a recent conversation (the
template's system prompt, a spoken conversation's earlier turns) prefills only what follows.

Sampling is greedy unless the request sets a temperature (a 135M model is unreliable when
sampled); a sampled request draws from its own seeded `torch.Generator`.

A step is all or nothing (the engine's failure isolation relies on it): the forward runs into
temporaries, generators are rewound if anything raises, and states change only at the end.
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
from typing import TypeVar, assert_never

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from stagemesh.models.options import capped_option
from stagemesh.services.kv_batching import (
    KvLayers,
    layer_kv,
    left_padded_cache,
    live,
    nucleus,
    padding_mask,
)
from stagemesh.services.thinker.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS, PrefixCache
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)
from stagemesh.shared.limits import MAX_SEED

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
#: One request's KV cache: per layer, keys and values [1, kv_heads, tokens, head_dim].

#: Option defaults. A chat answer of 256 tokens is a long paragraph; 1024 is the cap.
DEFAULT_MAX_PROMPT_TOKENS = 2048
DEFAULT_MAX_TOKENS_LIMIT = 1024
DEFAULT_MAX_TOKENS = 256
#: Characters of all messages together, checked before tokenizing (bounds that work too).
DEFAULT_MAX_INPUT_CHARS = 32_768
DEFAULT_MAX_MESSAGES = 64
MAX_TEMPERATURE = 2.0
ROLES = frozenset({"system", "user", "assistant"})
#: The CPU dtype: float32 either way, so that answers do not depend on the CPU's features
#: (bfloat16 was ~1.5x faster on a CPU with AVX512-BF16 in the prototype, at a precision cost
#: a 135M model can ill afford). Operators may still set `dtype: bfloat16`.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)
#: Shown for a token that ends inside a multi-byte character (held back until it completes).
_INCOMPLETE = "\ufffd"


@dataclass(frozen=True)
class ThinkerLimits:
    """What the stage accepts (its Describe facts): options, tightened to the model's caps."""

    max_prompt_tokens: int
    max_tokens: int
    default_max_tokens: int
    max_input_chars: int
    max_messages: int
    max_temperature: float


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str


@dataclass(frozen=True)
class TokenSampling:
    """temperature 0 = greedy; top_p 1 = off; seed None = random (only sampling uses it)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class ThinkerInput:
    """One conversation to answer; max_tokens None = the stage's default."""

    messages: tuple[ChatMessage, ...]
    sampling: TokenSampling = field(default_factory=TokenSampling)
    max_tokens: int | None = None


@dataclass(frozen=True)
class TokenDelta:
    """What one step wrote: its token ids and the text they complete (may be empty)."""

    text: str
    token_ids: tuple[int, ...]
    first_token_index: int


class FinishReason(enum.Enum):
    STOP = "stop"  # the model's end-of-turn token
    LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class ThinkerResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int


@dataclass
class ThinkerState:
    """One request in flight. `layers` and `logits` are None once released."""

    request_id: str
    sampling: TokenSampling
    max_tokens: int
    prompt_ids: tuple[int, ...]  # the templated conversation
    generator: torch.Generator | None  # None = greedy
    layers: KvLayers | None
    logits: torch.Tensor | None  # [vocab] logits of the next token
    pending_token: int | None = None  # the last token, not yet fed to the model
    token_ids: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters of the decoded answer already streamed
    finish_reason: FinishReason | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class _Fed:
    """A request's model results after a forward, not yet stored in its state."""

    layers: KvLayers
    logits: torch.Tensor


class ThinkerAdapter:
    """The Thinker stage's model: a causal LM folder with a chat template."""

    stage = "thinker"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        max_tokens: int = DEFAULT_MAX_TOKENS_LIMIT,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        placement: Placement = CPU_FLOAT32,
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"{model_dir} has no chat template: it is not a chat model")
        self._model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=placement.dtype,
            device_map=placement.device_name)  # in eval mode
        self.placement = placement
        self._stop_ids = self._end_of_turn_ids()
        positions = int(getattr(self._model.config, "max_position_embeddings", 2048))
        self.limits = self._limits(max_prompt_tokens, max_tokens, default_max_tokens,
                                   max_input_chars, positions)
        self._prefixes = PrefixCache(max(0, prefix_cache_tokens))
        self._warm_prefix()

    @staticmethod
    def _limits(max_prompt_tokens: int, max_tokens: int, default_max_tokens: int,
                max_input_chars: int, positions: int) -> ThinkerLimits:
        prompt = capped_option("max_prompt_tokens", max_prompt_tokens, positions - 1)
        most = capped_option("max_tokens", max_tokens, positions - prompt)
        return ThinkerLimits(
            max_prompt_tokens=prompt, max_tokens=most,
            default_max_tokens=capped_option("default_max_tokens", default_max_tokens, most),
            max_input_chars=capped_option("max_input_chars", max_input_chars),
            max_messages=DEFAULT_MAX_MESSAGES, max_temperature=MAX_TEMPERATURE)

    def _end_of_turn_ids(self) -> frozenset[int]:
        """The ids that end an answer: the tokenizer's eos and the generation config's."""
        ids: set[int] = set()
        eos = self._model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        if not ids:
            raise ValueError("the model names no end-of-turn token")
        return frozenset(ids)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: ThinkerInput) -> None:
        self._check_messages(payload.messages)
        self._check_sampling(payload.sampling)
        max_tokens = self._max_tokens(payload)
        if not 1 <= max_tokens <= self.limits.max_tokens:
            raise InvalidInputError(
                "max_tokens", f"max_tokens must be in [1, {self.limits.max_tokens}], "
                f"got {max_tokens}")
        prompt = len(self.prompt_ids(payload.messages))
        if prompt > self.limits.max_prompt_tokens:
            raise InvalidInputError(
                "messages", f"the conversation is {prompt} tokens long, the limit is "
                f"{self.limits.max_prompt_tokens}")

    def _check_messages(self, messages: Sequence[ChatMessage]) -> None:
        limits = self.limits
        if not messages:
            raise InvalidInputError("messages", "messages must not be empty")
        if len(messages) > limits.max_messages:
            raise InvalidInputError("messages", f"{len(messages)} messages, the limit is "
                                    f"{limits.max_messages}")
        for message in messages:
            if message.role not in ROLES:
                raise InvalidInputError("messages", f"unknown role {message.role!r}; known: "
                                        f"{sorted(ROLES)}")
        chars = sum(len(message.content) for message in messages)
        if chars > limits.max_input_chars:
            raise InvalidInputError("messages", f"messages have {chars} characters, the limit "
                                    f"is {limits.max_input_chars}")

    def _check_sampling(self, sampling: TokenSampling) -> None:
        temperature, most = sampling.temperature, self.limits.max_temperature
        if not (math.isfinite(temperature) and 0 <= temperature <= most):
            raise InvalidInputError("temperature",
                                    f"temperature must be in [0, {most}], got {temperature}")
        if not 0 < sampling.top_p <= 1:
            raise InvalidInputError("top_p", f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.seed is not None and not 0 <= sampling.seed <= MAX_SEED:
            raise InvalidInputError("seed", f"seed must be in [0, {MAX_SEED}], got {sampling.seed}")

    def _max_tokens(self, payload: ThinkerInput) -> int:
        return self.limits.default_max_tokens if payload.max_tokens is None else payload.max_tokens

    def prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The conversation in the model's chat template, ready for the assistant's answer."""
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        rendered = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                      tokenize=False)
        if not isinstance(rendered, str):
            raise TypeError("the chat template did not render one string")
        # The template writes every special token itself.
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    # -- engine contract ----------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, request: EngineRequest[ThinkerInput]) -> ThinkerState:
        """Prefill: the prompt (after its longest cached prefix) through the model alone, into
        the request's own cache."""
        payload = request.payload
        prompt = self.prompt_ids(payload.messages)
        sampling = payload.sampling
        generator = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
            generator = torch.Generator(device=self._model.device).manual_seed(seed)
        fed = self._prefill(prompt)
        return ThinkerState(
            request_id=request.request_id, sampling=sampling,
            max_tokens=self._max_tokens(payload), prompt_ids=tuple(prompt),
            generator=generator, layers=fed.layers, logits=fed.logits)

    def _prefill(self, prompt: list[int]) -> _Fed:
        """The prompt through the model after its longest cached prefix (all of it on a
        miss); the prompt is kept for the requests that begin like it."""
        cached, layers = self._prefixes.longest(prompt)
        fed = self._forward(torch.tensor([prompt[cached:]], device=self._model.device),
                            [layers], [cached])[0]
        self._prefixes.keep(prompt, fed.layers)
        return fed

    @torch.inference_mode()
    def _warm_prefix(self) -> None:
        """Prefill what a conversation without a system message of its own begins with (the
        template's default system prompt), so that its first turn prefills the rest only."""
        if self._prefixes.max_tokens:
            self._prefill(self.prompt_ids([ChatMessage("user", "")]))

    def add_input(self, state: ThinkerState, payload: NoStream) -> None:
        assert_never(payload)  # the whole conversation comes with the start

    @torch.inference_mode()
    def step(self, states: Sequence[ThinkerState]) -> list[StepOutput[TokenDelta]]:
        generators = [s.generator.get_state() if s.generator else None for s in states]
        try:
            fed = self._feed_pending(states)
            tokens = [self._sample(f.logits, s) for f, s in zip(fed, states, strict=True)]
        except BaseException:
            for state, saved in zip(states, generators, strict=True):
                if state.generator is not None and saved is not None:
                    state.generator.set_state(saved)
            raise
        return [self._advance(state, result, token)
                for state, result, token in zip(states, fed, tokens, strict=True)]

    def finish(self, state: ThinkerState) -> ThinkerResult:
        return ThinkerResult(text=self._answer_text(state), token_ids=tuple(state.token_ids),
                             finish_reason=state.finish_reason or FinishReason.LENGTH,
                             prompt_tokens=state.prompt_tokens)

    def release(self, state: ThinkerState) -> None:
        if state.layers is not None:  # the conversation so far: its next turn starts warm
            self._prefixes.keep([*state.prompt_ids, *state.token_ids[:-1]], state.layers)
        state.layers = None
        state.logits = None

    def batch_key(self, state: ThinkerState) -> Hashable:
        return self.stage

    # -- one token ----------------------------------------------------------------------------

    def _feed_pending(self, states: Sequence[ThinkerState]) -> list[_Fed]:
        """Every state's results after its last token (one batched forward for those that have
        one; a state just prefilled keeps its own); no state is changed."""
        pending = [s for s in states if s.pending_token is not None]
        fed = iter(self._forward(
            torch.tensor([[s.pending_token] for s in pending], device=self._model.device),
            [live(s.layers, s.request_id) for s in pending],
            [s.prompt_tokens + len(s.token_ids) - 1 for s in pending],
        ) if pending else [])
        return [next(fed) if s.pending_token is not None
                else _Fed(live(s.layers, s.request_id), live(s.logits, s.request_id))
                for s in states]

    def _forward(self, input_ids: torch.Tensor,
                 caches: Sequence[KvLayers],
                 positions: Sequence[int]) -> list[_Fed]:
        """One forward of `input_ids` [rows, new] after each row's cache (left-padded into one
        batch cache, padding masked); returns each row's extended cache and last logits."""
        new = input_ids.shape[1]
        lengths = [_cache_length(cache) for cache in caches]
        longest = max(lengths)
        batch = left_padded_cache(caches, longest, self._model.config)
        mask = padding_mask(lengths, new)
        device = self._model.device
        steps = torch.arange(new, device=device)
        position_ids = torch.tensor(list(positions), device=device)[:, None] + steps[None]
        out = self._model(input_ids=input_ids, attention_mask=mask.to(device),
                          position_ids=position_ids, cache=batch, use_cache=True,
                          logits_to_keep=1)
        layers = [layer_kv(entry) for entry in batch.layers]
        return [_Fed([(k[row:row + 1, :, longest - length:], v[row:row + 1, :, longest - length:])
                      for k, v in layers], out.logits[row, -1])
                for row, length in enumerate(lengths)]

    def _sample(self, logits: torch.Tensor, state: ThinkerState) -> int:
        sampling = state.sampling
        if state.generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
        if sampling.top_p < 1:
            kept = nucleus(probs, sampling.top_p, logits=False)
            probs = torch.where(kept, probs, torch.zeros_like(probs))
        return int(torch.multinomial(probs, 1, generator=state.generator)[0])

    def _advance(self, state: ThinkerState, fed: _Fed, token: int) -> StepOutput[TokenDelta]:
        """Store the step's results (cannot raise: the step has succeeded)."""
        state.layers, state.logits = fed.layers, fed.logits
        index = len(state.token_ids)
        state.token_ids.append(token)
        state.pending_token = token
        if token in self._stop_ids:
            state.finish_reason = FinishReason.STOP
        elif len(state.token_ids) >= state.max_tokens:
            state.finish_reason = FinishReason.LENGTH
        finished = state.finish_reason is not None
        text = self._answer_text(state)
        # Hold back a trailing partial character until a later token completes it.
        ready = text if finished else text.rstrip(_INCOMPLETE)
        delta = TokenDelta(text=ready[state.text_sent:], token_ids=(token,),
                           first_token_index=index)
        state.text_sent = max(state.text_sent, len(ready))
        return StepOutput(step_index=len(state.token_ids), partial=delta, finished=finished)

    def _answer_text(self, state: ThinkerState) -> str:
        text = self.tokenizer.decode(state.token_ids, skip_special_tokens=True)
        if not isinstance(text, str):
            raise TypeError("the tokenizer decoded one sequence into several")
        return text


def _cache_length(cache: KvLayers) -> int:
    return int(cache[0][0].shape[-2]) if cache else 0


#: The static proof that the adapter is the Thinker stage's StageAdapter.
_: type[StageAdapter[ThinkerInput, NoStream, ThinkerState, TokenDelta, ThinkerResult]] = (
    ThinkerAdapter
)
