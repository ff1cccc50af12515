"""The Thinker adapter on the real SmolLM2-135M-Instruct: batching, abort, sampling, limits."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from stagemesh.models.smollm2 import BUILD_STAMP_FILE, ensure_smollm2
from stagemesh.services.thinker.causal_lm_adapter import (
    ChatMessage,
    FinishReason,
    ThinkerAdapter,
    ThinkerInput,
    ThinkerState,
    TokenSampling,
)
from stagemesh.services.thinker.prefix_cache import PrefixCache
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.events import Aborted, Partial

pytestmark = pytest.mark.timeout(180)

FRANCE = "What is the capital of France?"
SEA = "Tell me three facts about the sea, one sentence each."


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_smollm2()


@pytest.fixture(scope="module")
def thinker(model_dir: Path) -> ThinkerAdapter:
    return ThinkerAdapter(model_dir)


def ask(text: str, max_tokens: int = 8, sampling: TokenSampling | None = None,
        request_id: str = "r") -> EngineRequest[ThinkerInput]:
    return EngineRequest(request_id=request_id, payload=ThinkerInput(
        messages=(ChatMessage("user", text),), max_tokens=max_tokens,
        sampling=sampling or TokenSampling()))


def run(thinker: ThinkerAdapter, requests: Sequence[EngineRequest[ThinkerInput]],
        join_after: int = 0) -> list[tuple[int, ...]]:
    """Step the requests together until each finishes; all but the first join the batch
    after `join_after` steps of the first (continuous batching: a request joins mid-answer)."""
    states = [thinker.prepare(requests[0])]
    for _ in range(join_after):
        thinker.step(states)
    states += [thinker.prepare(request) for request in requests[1:]]
    live: list[ThinkerState] = list(states)
    while live:
        outputs = thinker.step(live)
        live = [s for s, out in zip(live, outputs, strict=True) if not out.finished]
    return [thinker.finish(state).token_ids for state in states]


def test_the_folder_is_a_converted_safetensors_copy(model_dir: Path) -> None:
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / BUILD_STAMP_FILE).is_file()
    assert not list(model_dir.glob("*.gguf"))  # the GGUF is read once, at prepare time


def test_it_knows_the_capital_of_france(thinker: ThinkerAdapter) -> None:
    state = thinker.prepare(ask(FRANCE, max_tokens=30))
    deltas = []
    while True:
        (output,) = thinker.step([state])
        assert output.partial is not None
        deltas.append(output.partial.text)
        if output.finished:
            break
    result = thinker.finish(state)
    assert "Paris" in result.text
    assert "".join(deltas) == result.text  # the streamed pieces are the answer
    assert result.finish_reason is FinishReason.STOP and result.prompt_tokens > 5


def test_batched_answers_equal_solo_answers_under_greedy(thinker: ThinkerAdapter) -> None:
    requests = [ask(FRANCE, request_id="a"), ask(SEA, request_id="b"),
                ask("Say hello in one sentence.", request_id="c")]
    solo = [run(thinker, [request])[0] for request in requests]
    # Three prompts of different lengths in one batch, two of them joining after 3 tokens.
    assert run(thinker, requests, join_after=3) == solo


def test_a_seed_makes_sampling_reproducible(thinker: ThinkerAdapter) -> None:
    def sample(seed: int) -> tuple[int, ...]:
        sampling = TokenSampling(temperature=1.0, seed=seed)
        return run(thinker, [ask(SEA, max_tokens=6, sampling=sampling)])[0]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_check_inputs_names_the_field(thinker: ThinkerAdapter) -> None:
    cases = {
        "max_tokens": ask(FRANCE, max_tokens=thinker.limits.max_tokens + 1),
        "temperature": ask(FRANCE, sampling=TokenSampling(temperature=-1)),
        "top_p": ask(FRANCE, sampling=TokenSampling(top_p=0)),
        "messages": EngineRequest(request_id="x", payload=ThinkerInput(
            messages=(ChatMessage("robot", "hi"),))),
    }
    for field, request in cases.items():
        with pytest.raises(InvalidInputError) as refused:
            thinker.check_inputs(request.payload)
        assert refused.value.field_name == field


def test_a_prompt_longer_than_the_published_limit_is_refused(model_dir: Path) -> None:
    small = ThinkerAdapter(model_dir, max_prompt_tokens=16)
    assert small.limits.max_prompt_tokens == 16
    with pytest.raises(InvalidInputError, match="the limit is 16") as refused:
        small.check_inputs(ask(FRANCE).payload)  # the default system prompt alone is longer
    assert refused.value.field_name == "messages"


async def test_an_abort_stops_the_answer_at_a_token_boundary(thinker: ThinkerAdapter) -> None:
    engine = StepEngine(thinker, max_running=2)
    engine.start()
    try:
        request = ask(SEA, max_tokens=200, request_id="long")
        stream = engine.submit(EngineRequest(request_id="long", payload=request.payload,
                                             budget=StepBudget(total_steps=None)))
        tokens = 0
        events = []
        async with asyncio.timeout(60):
            async for event in stream:
                events.append(event)
                if isinstance(event, Partial):
                    tokens += 1
                    if tokens == 3:
                        engine.abort("long")
        aborted = events[-1]
        assert isinstance(aborted, Aborted)
        # Every step that ran streamed its token; none ran after the abort's boundary but the
        # one in flight when it arrived.
        assert aborted.step_index == tokens and 3 <= tokens <= 4
    finally:
        engine.shutdown()


def test_a_next_turn_prefills_only_what_follows_the_conversation_so_far(
        thinker: ThinkerAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    first = thinker.prepare(ask(FRANCE, max_tokens=12, request_id="turn-1"))
    while not thinker.step([first])[0].finished:
        pass
    said = thinker.finish(first).text
    thinker.release(first)  # the conversation's cache is kept for its next turn
    follow = EngineRequest(request_id="turn-2", payload=ThinkerInput(messages=(
        ChatMessage("user", FRANCE), ChatMessage("assistant", said),
        ChatMessage("user", "And of Italy?")), max_tokens=10))
    fed: list[int] = []
    forward = thinker._forward

    def counting(input_ids: torch.Tensor, caches: Any, positions: Any) -> Any:
        fed.append(int(input_ids.shape[1]))
        return forward(input_ids, caches, positions)

    monkeypatch.setattr(thinker, "_forward", counting)
    hot = run(thinker, [follow])[0]
    prompt = len(thinker.prompt_ids(follow.payload.messages))
    # The first turn's prompt and answer were not fed again: only the new question's tokens.
    assert fed[0] <= prompt - first.prompt_tokens - len(first.token_ids) + 2, (fed[0], prompt)
    # And the answer is the one a cold prefill gives.
    monkeypatch.setattr(thinker, "_prefixes", PrefixCache(0))
    assert run(thinker, [follow])[0] == hot
