"""TalkerAdapter on the tiny CSM (and the tiny speech model builder it loads)."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoProcessor, CsmForConditionalGeneration

from stagemesh.models.families.csm import (
    ChatMarkers,
    CsmPromptFormat,
    codec_dir,
    load_voices,
)
from stagemesh.models.speech import (
    BUILD_STAMP_FILE,
    DEFAULT_VOICES,
    ensure_speech_model,
)
from stagemesh.services.talker.csm_adapter import (
    FinishReason,
    SamplingParams,
    TalkerAdapter,
    TalkerInput,
    TalkerLimits,
    TalkerState,
    VoiceContext,
)
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError
from stagemesh.shared.limits import MAX_SEED


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
    for _ in range(state.max_new_frames):  # one frame per step: it must finish by then
        out = talker.step([state])[0]
        frames.append(out.partial)
        if out.finished:
            break
    assert out.finished, f"not finished after max_new_frames={state.max_new_frames} steps"
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


def test_chat_markers_are_the_folders(model_dir: Path, processor: Any) -> None:
    """The tiny folder keeps its markers where a real CSM folder does: bos/eos in the
    tokenizer, the audio tokens resolved by CsmProcessor; the chat template uses bos/eos."""
    prompt = CsmPromptFormat.from_folder(model_dir)
    assert prompt.markers == ChatMarkers(
        segment_start="<|im_start|>",
        segment_end="<|im_end|>",
        audio="<|AUDIO|>",
        audio_eos="<|audio_eos|>",
    )
    assert (processor.audio_token, processor.audio_eos_token) == ("<|AUDIO|>", "<|audio_eos|>")
    template = (model_dir / "chat_template.jinja").read_text()
    assert "bos_token" in template and "eos_token" in template and "<|im_start|>" not in template
    conversation = [{"role": "1", "content": [{"type": "text", "text": "Hello world."}]}]
    by_template = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    ours = prompt.segment_ids(1, prompt.encode("Hello world."))
    assert by_template["input_ids"][0].tolist() == ours


def test_chat_markers_follow_the_folder_not_the_builder(model_dir: Path, tmp_path: Path) -> None:
    """Another folder with other bos/eos tokens (as sesame/csm-1b has Llama-3's) gets prompts
    built with its own tokens."""
    other = tmp_path / "other-csm"
    shutil.copytree(model_dir, other)
    config_file = other / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(bos_token="<|vision_start|>", eos_token="<|vision_end|>")
    config_file.write_text(json.dumps(config))
    prompt = CsmPromptFormat.from_folder(other)
    assert (prompt.markers.segment_start, prompt.markers.segment_end) == (
        "<|vision_start|>",
        "<|vision_end|>",
    )
    ids = prompt.segment_ids(0, [9707])
    tokenizer = prompt.tokenizer
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert prompt.reference_audio_ids(2) == [
        tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
        tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
        tokenizer.convert_tokens_to_ids("<|audio_eos|>"),
    ]


def test_voices_file_is_checked(tmp_path: Path) -> None:
    (tmp_path / "voices.json").write_text(json.dumps({"voices": {"Alice": 3, "bob": 1}}))
    assert load_voices(tmp_path) == {"alice": 3, "bob": 1}
    assert list(load_voices(tmp_path)) == ["alice", "bob"]  # the folder's order
    for bad in ({"default": 0}, {"clone": 0}, {"a": -1}, {"A": 0, "a": 1}, {}):
        (tmp_path / "voices.json").write_text(json.dumps({"voices": bad}))
        with pytest.raises(ValueError, match=r"voices\.json"):
            load_voices(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"voices\.json"):
        load_voices(tmp_path / "missing")


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


def _snapshot(state: TalkerState) -> list[object]:
    """Everything a step may change in a state, copied."""
    assert state.cache is not None and state.logits is not None and state.hidden is not None
    entries = [
        (layer.keys.clone(), layer.values.clone())
        for layer in state.cache.layers
        if layer.keys is not None and layer.values is not None
    ]
    pending = None if state.pending_frame is None else state.pending_frame.clone()
    return [
        state.cache.get_seq_length(),
        entries,
        state.generator.get_state(),
        state.logits.clone(),
        state.hidden.clone(),
        pending,
        [frame.clone() for frame in state.frames],
        state.steps,
        state.finish_reason,
    ]


def _assert_same(actual: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected)
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    else:
        assert actual == expected


def test_a_row_that_raises_leaves_every_state_as_it_was(
    talker: TalkerAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All or nothing: the engine re-steps the members of a failed batch one by one, so a
    failed step must advance no cache, generator, frame or pending frame."""
    good = {
        "a": _request("Hello world.", seed=1, frames=4),
        "b": _request("A longer second sentence, with more tokens.", seed=2, frames=4),
    }
    bad = _request("Something else entirely.", seed=3, frames=4)
    reference = {rid: _prepare(talker, payload, rid) for rid, payload in good.items()}
    expected: dict[str, list[torch.Tensor]] = {rid: [] for rid in good}
    for _ in range(3):  # the batch without the bad row
        batch = list(reference.values())
        for state, out in zip(batch, talker.step(batch), strict=True):
            expected[state.request_id].append(out.partial)

    states = [_prepare(talker, payload, rid) for rid, payload in good.items()]
    states.append(_prepare(talker, bad, "bad"))
    talker.step(states)  # every row now has a pending frame: the next step feeds the backbone
    before = [_snapshot(state) for state in states]
    sample = talker._sample
    calls = {"bad": 0}

    def sample_then_fail(logits: torch.Tensor, state: TalkerState) -> torch.Tensor:
        if state.request_id == "bad":
            calls["bad"] += 1
            if calls["bad"] == 3:  # mid depth decoder: every row has drawn from its generator
                raise RuntimeError("sampling failed")
        return sample(logits, state)

    monkeypatch.setattr(talker, "_sample", sample_then_fail)
    with pytest.raises(RuntimeError, match="sampling failed"):
        talker.step(states)
    monkeypatch.undo()
    for state, snapshot in zip(states, before, strict=True):
        _assert_same(_snapshot(state), snapshot)

    for state in states[:2]:  # the engine's isolation: each good row alone
        for _ in range(2):
            talker.step([state])
        _assert_same(state.frames, expected[state.request_id])


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
    ref_segment = len(talker._prompt.segment_ids(0, talker._prompt.encode("Reference.")))
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
        (TalkerInput(text="hi", sampling=SamplingParams(temperature=10.5)), "temperature"),
        (TalkerInput(text="hi", sampling=SamplingParams(top_p=0)), "top_p"),
        (TalkerInput(text="hi", sampling=SamplingParams(top_p=1.5)), "top_p"),
        (TalkerInput(text="hi", sampling=SamplingParams(top_k=-1)), "top_k"),
        (TalkerInput(text="hi", sampling=SamplingParams(top_k=10_001)), "top_k"),
        (TalkerInput(text="hi", sampling=SamplingParams(seed=-3)), "seed"),
        (TalkerInput(text="hi", sampling=SamplingParams(seed=MAX_SEED + 1)), "seed"),
        (TalkerInput(text="hi", max_new_frames=0), "max_new_tokens"),
        (TalkerInput(text="hi", max_new_frames=751), "max_new_tokens"),  # the stage's limit
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


# -- limits and options -------------------------------------------------------------------------


def test_limits_are_published(talker: TalkerAdapter) -> None:
    assert talker.limits == TalkerLimits(
        voices=("vivian", "ryan", "serena", "uncle_fu"),
        default_voice="vivian",
        supports_voice_clone=True,
        max_input_chars=4096,
        max_reference_text_chars=4096,
        max_new_frames=750,
        default_max_new_frames=250,
        frame_rate=12.5,
        max_temperature=10.0,
        max_top_k=10_000,
    )


def test_no_max_new_frames_means_the_default(talker: TalkerAdapter) -> None:
    state = _prepare(talker, TalkerInput(text="hi", sampling=SamplingParams(seed=1)))
    assert state.max_new_frames == 250
    talker.release(state)


@pytest.mark.parametrize("voice", [None, "", "default", "DEFAULT"])
def test_default_voice_is_the_configured_one(model_dir: Path, voice: str | None) -> None:
    talker = TalkerAdapter(model_dir, default_voice="Serena")
    assert talker.limits.default_voice == "serena"
    by_default = _run_alone(talker, _request(frames=3, voice=voice))
    assert torch.equal(by_default, _run_alone(talker, _request(frames=3, voice="serena")))
    assert not torch.equal(by_default, _run_alone(talker, _request(frames=3, voice="ryan")))


def test_options_are_capped_by_the_model(model_dir: Path) -> None:
    loose = TalkerAdapter(model_dir, max_new_frames=10**6)
    assert loose.limits.max_new_frames == 2048  # the tiny CSM's positions
    tight = TalkerAdapter(model_dir, max_input_chars=10, max_new_frames=100)
    assert (tight.limits.max_input_chars, tight.limits.max_new_frames) == (10, 100)
    assert tight.limits.default_max_new_frames == 100  # never above the limit
    for payload, field in [
        (TalkerInput(text="x" * 11), "input"),
        (TalkerInput(text="hi", max_new_frames=101), "max_new_tokens"),
    ]:
        with pytest.raises(InvalidInputError) as info:
            tight.check_inputs(payload)
        assert info.value.field_name == field
    tight.check_inputs(TalkerInput(text="x" * 10, max_new_frames=100))


@pytest.mark.parametrize(
    "options",
    [{"default_voice": "nobody"}, {"max_new_frames": 0}, {"max_input_chars": 0}],
)
def test_bad_options_fail_at_construction(model_dir: Path, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        TalkerAdapter(model_dir, **options)
