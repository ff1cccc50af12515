"""The Tokenizer stage encodes a batch of prompts in one forward, each exactly as alone.

The reference for "alone" is the pipeline itself: `QwenImagePipeline.encode_prompt` on one
prompt (the stage's behaviour before it batched).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from stagemesh.models import qwen_image
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.tokenizer.base import PromptInput, PromptState
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter
from stagemesh.services.tokenizer.servicer import build_stage
from stagemesh.shared.engine.adapter import EngineRequest

#: Batched rows may differ from rows encoded alone by float rounding only.
TOLERANCE = 1e-5

SHORT = "a red circle"
LONG = "a small blue square in the top right corner next to a large green triangle, flat colours"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_image.build_tiny_qwen_image(tmp_path_factory.mktemp("qwen-image") / "tiny")


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> PromptEncoderAdapter:
    return PromptEncoderAdapter(model_dir)


def _states(encoder: PromptEncoderAdapter, inputs: Sequence[PromptInput]) -> list[PromptState]:
    states = []
    for index, payload in enumerate(inputs):
        encoder.check_inputs(payload)
        states.append(encoder.prepare(EngineRequest(request_id=f"r{index}", payload=payload)))
    return states


def _pipeline_alone(
    encoder: PromptEncoderAdapter, text: str, max_sequence_length: int
) -> torch.Tensor:
    """What the pipeline gives one prompt: its embeddings; the mask must be None."""
    embeds, mask = encoder._pipeline.encode_prompt(
        prompt=text, device=torch.device("cpu"), max_sequence_length=max_sequence_length
    )
    assert mask is None  # one prompt alone: every token valid, the pipeline drops the mask
    return embeds


def _assert_close(actual: torch.Tensor | None, expected: torch.Tensor) -> None:
    assert actual is not None
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert (actual - expected).abs().max().item() <= TOLERANCE


def _assert_as_alone(
    encoder: PromptEncoderAdapter, payload: PromptInput, result: PromptEmbeddings
) -> None:
    length = payload.max_sequence_length or encoder.limits.max_sequence_length
    _assert_close(result.prompt_embeds, _pipeline_alone(encoder, payload.prompt, length))
    assert result.prompt_embeds_mask is None
    assert result.negative_prompt_embeds_mask is None
    if payload.negative_prompt is None:
        assert result.negative_prompt_embeds is None
    else:
        expected = _pipeline_alone(encoder, payload.negative_prompt, length)
        _assert_close(result.negative_prompt_embeds, expected)


def test_a_batch_encodes_each_prompt_as_alone(encoder: PromptEncoderAdapter) -> None:
    exact = encoder.prompt_token_count(LONG)  # a limit the long prompt just fits
    inputs = [
        PromptInput(SHORT),
        PromptInput(LONG, negative_prompt=""),
        PromptInput(SHORT, negative_prompt="blurry, low quality, washed out colours"),
        PromptInput(LONG, negative_prompt="blurry", max_sequence_length=exact),
        PromptInput("x", negative_prompt=LONG, max_sequence_length=exact + 3),
    ]
    states = _states(encoder, inputs)
    outputs = encoder.step(states)
    assert [(o.step_index, o.finished, o.error) for o in outputs] == [(1, True, None)] * 5
    for payload, state in zip(inputs, states, strict=True):
        _assert_as_alone(encoder, payload, encoder.finish(state))


def test_one_prompt_alone_is_the_pipeline_exactly(encoder: PromptEncoderAdapter) -> None:
    """A single text needs no padding: the forward is the pipeline's own. (A negative prompt
    shares the forward, so it is covered by the tolerance above.)"""
    (state,) = _states(encoder, [PromptInput(LONG)])
    encoder.step([state])
    result = encoder.finish(state)
    limit = encoder.limits.max_sequence_length
    assert torch.equal(result.prompt_embeds, _pipeline_alone(encoder, LONG, limit))
    assert result.prompt_embeds_mask is None and result.negative_prompt_embeds is None


def test_results_do_not_depend_on_batch_mates(encoder: PromptEncoderAdapter) -> None:
    payload = PromptInput(SHORT, negative_prompt="")
    alone = _states(encoder, [payload])
    encoder.step(alone)
    mates = _states(encoder, [PromptInput(LONG, negative_prompt=LONG), payload])
    encoder.step(mates)
    first, second = encoder.finish(alone[0]), encoder.finish(mates[1])
    _assert_close(second.prompt_embeds, first.prompt_embeds)
    assert first.negative_prompt_embeds is not None
    _assert_close(second.negative_prompt_embeds, first.negative_prompt_embeds)


def test_a_text_repeated_in_a_batch_is_encoded_once(
    encoder: PromptEncoderAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst sharing its negative prompt (and two requests for one prompt) costs one row per
    distinct text; every request still gets what it gets alone."""
    inputs = [
        PromptInput(SHORT, negative_prompt=""),
        PromptInput(SHORT, negative_prompt=""),
        PromptInput(LONG, negative_prompt=""),
        PromptInput(LONG, negative_prompt=SHORT),
    ]
    states = _states(encoder, inputs)
    forwards: list[list[str]] = []
    encode_prompt = encoder._pipeline.encode_prompt

    def recording(*args: object, prompt: list[str], **kwargs: object) -> object:
        forwards.append(list(prompt))
        return encode_prompt(*args, prompt=prompt, **kwargs)

    monkeypatch.setattr(encoder._pipeline, "encode_prompt", recording)
    encoder.step(states)
    monkeypatch.undo()
    assert forwards == [[SHORT, LONG, ""]]
    for payload, state in zip(inputs, states, strict=True):
        _assert_as_alone(encoder, payload, encoder.finish(state))


def test_counting_ignores_the_padding_and_truncation_a_batch_leaves(
    encoder: PromptEncoderAdapter,
) -> None:
    """The counter shares the batch encoder's Rust tokenizer, on which a batch call sets
    padding and truncation: a count must still see every token of a text that is too long (or
    the stage would let it through to be cut silently) and no padding of a short one."""
    too_long = "word " * (encoder.limits.max_sequence_length + 500)
    before = encoder.prompt_token_count(too_long), encoder.prompt_token_count(SHORT)
    backend = encoder._pipeline.tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=64)  # settings a batch encoder could leave behind
    backend.enable_padding(length=96)
    after = encoder.prompt_token_count(too_long), encoder.prompt_token_count(SHORT)
    assert after == before
    assert before[0] > encoder.limits.max_sequence_length + 400 and before[1] < 64
    encoder.step(_states(encoder, [PromptInput(SHORT), PromptInput(LONG)]))  # still encodes
    assert encoder.prompt_token_count(SHORT) == before[1]


def test_a_failed_batch_changes_no_state(
    encoder: PromptEncoderAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = _states(encoder, [PromptInput(SHORT), PromptInput(LONG, negative_prompt="")])

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("text encoder failed")

    monkeypatch.setattr(encoder._pipeline, "encode_prompt", broken)
    with pytest.raises(RuntimeError, match="text encoder failed"):
        encoder.step(states)
    assert all(state.result is None for state in states)
    monkeypatch.undo()
    encoder.step(states)  # the engine's isolation steps them again: they encode normally
    assert all(state.result is not None for state in states)


def test_the_stage_engine_batches_a_burst(model_dir: Path) -> None:
    bundle = build_stage(model_dir, {})
    (engine,) = bundle.engines
    assert engine.max_running >= 8  # a burst of 8 prompts is encoded in one step
