"""TalkerAdapter on the tiny CSM (and the tiny speech model builder it loads)."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoProcessor, CsmForConditionalGeneration

from stagemesh.models.speech import (
    BUILD_STAMP_FILE,
    DEFAULT_VOICES,
    codec_dir,
    ensure_speech_model,
    load_voices,
)
from stagemesh.services.talker.adapter import (
    FinishReason,
    SamplingParams,
    TalkerAdapter,
    TalkerInput,
    TalkerState,
    VoiceContext,
)
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_speech_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def talker(model_dir: Path) -> TalkerAdapter:
    return TalkerAdapter(model_dir)


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(model_dir, local_files_only=True)


def _request(
    text: str = "Hello world.", seed: int = 1, frames: int = 6, **kwargs: object
) -> TalkerInput:
    return TalkerInput(
        text=text, sampling=SamplingParams(seed=seed), max_new_frames=frames, **kwargs
    )


def _prepare(talker: TalkerAdapter, payload: TalkerInput, request_id: str = "r") -> TalkerState:
    talker.check_inputs(payload)
    return talker.prepare(EngineRequest(request_id=request_id, payload=payload))


def _run_alone(talker: TalkerAdapter, payload: TalkerInput) -> torch.Tensor:
    state = _prepare(talker, payload)
    frames = []
    while True:
        out = talker.step([state])[0]
        frames.append(out.partial)
        if out.finished:
            break
    talker.release(state)
    return torch.stack(frames)


# -- the model folder ---------------------------------------------------------------------------


def test_model_folder_loads_offline_in_real_layout(model_dir: Path, processor: Any) -> None:
    model = CsmForConditionalGeneration.from_pretrained(model_dir, local_files_only=True)
    assert type(processor).__name__ == "CsmProcessor"
    assert model.config.codec_config.model_type == "mimi"
    assert codec_dir(model_dir) == model_dir / "codec"
    assert model.config.num_codebooks == model.config.codec_config.num_quantizers
    assert load_voices(model_dir) == DEFAULT_VOICES
    prompt = processor.apply_chat_template(
        [{"role": "0", "content": [{"type": "text", "text": "Hi"}]}], tokenize=False
    )
    assert prompt == "<|im_start|>[0]Hi<|im_end|>"


def test_ensure_builds_once_and_replaces_stale(model_dir: Path) -> None:
    stamp = model_dir / BUILD_STAMP_FILE
    before = stamp.stat().st_mtime_ns
    assert ensure_speech_model(model_dir.parent.parent) == model_dir
    assert stamp.stat().st_mtime_ns == before  # not rebuilt
    stamp.write_text(json.dumps({"version": -1}))
    assert ensure_speech_model(model_dir.parent.parent) == model_dir
    assert json.loads(stamp.read_text())["version"] != -1
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [model_dir.name]  # no temp left


# -- stepping -----------------------------------------------------------------------------------


def test_one_frame_per_step_until_max_new_frames(talker: TalkerAdapter) -> None:
    state = _prepare(talker, _request(frames=4))
    outputs = [talker.step([state])[0] for _ in range(4)]
    assert [o.step_index for o in outputs] == [1, 2, 3, 4]
    assert [o.finished for o in outputs] == [False, False, False, True]
    for out in outputs:
        assert out.partial.shape == (talker.num_codebooks,) and out.partial.dtype == torch.int64
        assert int(out.partial.min()) >= 0 and int(out.partial.max()) < 64  # decodable by Mimi
    result = talker.finish(state)
    assert result.finish_reason is FinishReason.LENGTH
    assert torch.equal(result.frames, torch.stack([o.partial for o in outputs]))


def test_same_seed_same_frames_other_seed_differs(talker: TalkerAdapter) -> None:
    first = _run_alone(talker, _request(seed=7))
    again = _run_alone(talker, _request(seed=7))
    other = _run_alone(talker, _request(seed=8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_batched_requests_match_each_run_alone(talker: TalkerAdapter) -> None:
    a = _request("Hello world.", seed=1, frames=8, voice="ryan")
    b = TalkerInput(
        text="A longer second sentence, with more tokens.",
        voice="Serena",
        sampling=SamplingParams(seed=2, top_p=0.8, top_k=20, temperature=1.1),
        max_new_frames=5,
    )
    alone_a, alone_b = _run_alone(talker, a), _run_alone(talker, b)

    state_a = _prepare(talker, a, "a")
    frames: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    live = [state_a]
    for tick in range(10):
        if tick == 2:  # b joins between steps, while a is mid-generation
            live.append(_prepare(talker, b, "b"))
        for state, out in zip(live, talker.step(live), strict=True):
            frames[state.request_id].append(out.partial)
        live = [s for s in live if len(frames[s.request_id]) < s.max_new_frames]
        if not live:
            break
    assert torch.equal(torch.stack(frames["a"]), alone_a)
    assert torch.equal(torch.stack(frames["b"]), alone_b)


def test_greedy_matches_transformers_generate(talker: TalkerAdapter, processor: Any) -> None:
    payload = TalkerInput(
        text="Hello world.",
        voice="ryan",
        sampling=SamplingParams(temperature=0),
        max_new_frames=10,
        stop_on_end_of_audio=False,
    )
    ours = _run_alone(talker, payload)
    model = talker._model  # loaded by CsmForConditionalGeneration.from_pretrained
    inputs = processor(text="<|im_start|>[1]Hello world.<|im_end|>", return_tensors="pt")
    theirs = model.generate(
        input_ids=inputs.input_ids,
        do_sample=False,
        depth_decoder_do_sample=False,
        max_new_tokens=10,
    )[0]
    # Ours never samples CSM's ids past the codec's codebook; generate may, from there on the
    # two diverge. Before that they must agree exactly.
    codec_vocab = model.config.codec_config.codebook_size
    out_of_codebook = (theirs >= codec_vocab).any(dim=-1).nonzero()
    agree = int(out_of_codebook[0]) if out_of_codebook.numel() else theirs.shape[0]
    assert agree >= 2
    assert torch.equal(ours[:agree], theirs[:agree])


@pytest.fixture
def silent_heads(talker: TalkerAdapter) -> Iterator[None]:
    """Zero the codebook heads: every logit ties, greedy picks code 0, i.e. end of audio."""
    model = talker._model
    heads = [model.lm_head.weight, model.depth_decoder.codebooks_head.weight]
    saved = [h.detach().clone() for h in heads]
    with torch.no_grad():
        for head in heads:
            head.zero_()
    yield
    with torch.no_grad():
        for head, value in zip(heads, saved, strict=True):
            head.copy_(value)


@pytest.mark.usefixtures("silent_heads")
def test_stops_on_end_of_audio_frame(talker: TalkerAdapter) -> None:
    greedy = SamplingParams(temperature=0)
    state = _prepare(talker, TalkerInput(text="Hi.", sampling=greedy, max_new_frames=5))
    out = talker.step([state])[0]
    assert out.finished and out.partial is None and out.step_index == 1
    result = talker.finish(state)
    assert result.finish_reason is FinishReason.STOP and result.frames.shape == (0, 8)

    state = _prepare(
        talker,
        TalkerInput(text="Hi.", sampling=greedy, max_new_frames=2, stop_on_end_of_audio=False),
    )
    assert not talker.step([state])[0].finished
    assert talker.step([state])[0].finished


def test_release_frees_the_cache(talker: TalkerAdapter) -> None:
    state = _prepare(talker, _request(frames=50))
    talker.step([state])
    cache_ref = weakref.ref(state.cache)
    talker.release(state)
    gc.collect()
    assert cache_ref() is None
    with pytest.raises(RuntimeError, match="released"):
        talker.step([state])


def test_voice_clone_context_extends_the_prompt(talker: TalkerAdapter) -> None:
    codes = torch.randint(
        0, 64, (6, talker.num_codebooks), generator=torch.Generator().manual_seed(0)
    )
    plain = _prepare(talker, _request())
    cloned = _prepare(
        talker, _request(voice="clone", context=VoiceContext(codes=codes, text="Reference."))
    )
    ref_segment = len(talker._segment_ids(0, talker._tokenizer.encode("Reference.")))
    assert cloned.cache.get_seq_length() == plain.cache.get_seq_length() + ref_segment + 6 + 1
    assert not torch.equal(talker.step([plain])[0].partial, talker.step([cloned])[0].partial)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (TalkerInput(text=""), "input"),
        (TalkerInput(text="   "), "input"),
        (TalkerInput(), "input"),
        (TalkerInput(text="x" * 5000), "input"),
        (TalkerInput(token_ids=[]), "input"),
        (TalkerInput(token_ids=[-1]), "input"),
        (TalkerInput(text="hi", voice="nobody"), "voice"),
        (TalkerInput(text="hi", voice="clone"), "ref_audio"),
        (TalkerInput(text="hi", sampling=SamplingParams(temperature=-1)), "temperature"),
        (TalkerInput(text="hi", sampling=SamplingParams(temperature=float("nan"))), "temperature"),
        (TalkerInput(text="hi", sampling=SamplingParams(top_p=0)), "top_p"),
        (TalkerInput(text="hi", sampling=SamplingParams(top_p=1.5)), "top_p"),
        (TalkerInput(text="hi", sampling=SamplingParams(top_k=-1)), "top_k"),
        (TalkerInput(text="hi", sampling=SamplingParams(seed=-3)), "seed"),
        (TalkerInput(text="hi", max_new_frames=0), "max_new_tokens"),
        (TalkerInput(text="hi", max_new_frames=2045), "max_new_tokens"),
        (
            TalkerInput(text="hi", context=VoiceContext(codes=torch.zeros(3, 2, dtype=torch.long))),
            "ref_audio",
        ),
        (
            TalkerInput(text="hi", context=VoiceContext(codes=torch.full((3, 8), 64))),
            "ref_audio",
        ),
        (
            TalkerInput(
                text="hi",
                context=VoiceContext(codes=torch.zeros(3, 8, dtype=torch.long), text="x" * 5000),
            ),
            "ref_text",
        ),
    ],
)
def test_check_inputs_names_the_field(
    talker: TalkerAdapter, payload: TalkerInput, field: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        talker.check_inputs(payload)
    assert info.value.field_name == field


def test_voice_names_are_case_insensitive(talker: TalkerAdapter) -> None:
    talker.check_inputs(TalkerInput(text="hi", voice="Serena"))
    talker.check_inputs(TalkerInput(token_ids=[9707, 1879]))
    assert talker.voices == DEFAULT_VOICES
