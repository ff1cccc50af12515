"""The Piper voice split at z: the parts equal the stock voice, the talker is reproducible and
streams sentence by sentence, and the incremental codec equals a one-shot decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("piper", reason="the Piper voice needs the voice-gpl extra")

from stagemesh.models.families import family_of
from stagemesh.models.families.piper import (
    CODEC_INPUT,
    DURATION_NOISE,
    LATENT_OUTPUT,
    LENGTHS_INPUT,
    PHONEMES_INPUT,
    PRIOR_NOISE,
    SCALES_INPUT,
    PiperVoiceFolder,
    open_session,
)
from stagemesh.models.piper import MODEL_NAME, _stock_voice, ensure_piper_model
from stagemesh.models.registry import BUILTIN_FAMILIES
from stagemesh.services.codec.piper_adapter import (
    LatentDecodeInput,
    LatentFramesInput,
    PiperCodecAdapter,
)
from stagemesh.services.talker.piper_adapter import (
    PiperTalkerAdapter,
    PiperTalkerInput,
    PiperTalkerState,
)
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError

pytestmark = pytest.mark.timeout(180)

Floats = npt.NDArray[np.float32]
TEXT = "Hello there, how are you today? I have 3 apples. The weather is lovely."


@pytest.fixture(scope="module")
def folder() -> Path:
    return ensure_piper_model()


@pytest.fixture(scope="module")
def talker(folder: Path) -> PiperTalkerAdapter:
    return PiperTalkerAdapter(folder, chunk_frames=32)


@pytest.fixture(scope="module")
def codec(folder: Path) -> PiperCodecAdapter:
    return PiperCodecAdapter(folder)


def start(talker: PiperTalkerAdapter, **fields: object) -> PiperTalkerState:
    payload = PiperTalkerInput(**{"text": TEXT, "seed": 1, **fields})  # type: ignore[arg-type]
    talker.check_inputs(payload)
    return talker.prepare(EngineRequest("r", payload))


def run_talker(talker: PiperTalkerAdapter, state: PiperTalkerState) -> list[Floats]:
    chunks = []
    while True:
        out = talker.step([state])[0]
        if out.partial is not None:
            chunks.append(out.partial)
        if out.finished:
            return chunks


def test_the_registry_names_the_family_the_builder_writes(folder: Path) -> None:
    """`serve --strict` checks a built-in model's extras from the registry, before building."""
    assert family_of(folder) == BUILTIN_FAMILIES[MODEL_NAME]


def test_talker_then_codec_equals_the_stock_voice_bit_for_bit(
    folder: Path, talker: PiperTalkerAdapter, codec: PiperCodecAdapter
) -> None:
    # Zero noise inputs equal the stock graph with noise scales 0 (its noise is scaled by them).
    voice = PiperVoiceFolder.load(folder)
    stock = open_session(_stock_voice()[0])
    split_talker = open_session(voice.talker_graph)
    for sentence in start(talker).sentences:
        ids = np.asarray([sentence.ids], dtype=np.int64)
        lengths = np.asarray([ids.shape[1]], dtype=np.int64)
        scales = np.asarray([0.0, 1.0, 0.0], dtype=np.float32)
        expected = stock.run(None, {PHONEMES_INPUT: ids, LENGTHS_INPUT: lengths,
                                    SCALES_INPUT: scales})[0].reshape(-1)
        z = split_talker.run([LATENT_OUTPUT], {
            PHONEMES_INPUT: ids, LENGTHS_INPUT: lengths, SCALES_INPUT: scales,
            DURATION_NOISE: np.zeros((1, ids.shape[1], 2), np.float32),
            PRIOR_NOISE: np.zeros((1, 40 * ids.shape[1], 192), np.float32)})[0]
        audio = open_session(voice.codec_graph).run(None, {CODEC_INPUT: z})[0].reshape(-1)
        np.testing.assert_array_equal(audio, expected)


def test_the_talker_splits_sentences_streams_chunks_and_a_seed_reproduces_it(
    talker: PiperTalkerAdapter,
) -> None:
    state = start(talker)
    assert len(state.sentences) == 3
    chunks = run_talker(talker, state)
    assert all(0 < c.shape[0] <= 32 and c.shape[1] == 192 for c in chunks)
    assert talker.finish(state).finish_reason == "stop"
    first = np.concatenate(chunks)
    np.testing.assert_array_equal(np.concatenate(run_talker(talker, start(talker))), first)
    other = np.concatenate(run_talker(talker, start(talker, seed=2)))
    assert other.shape != first.shape or not np.allclose(other, first)


def test_max_new_frames_stops_the_talker_with_length(talker: PiperTalkerAdapter) -> None:
    state = start(talker, max_new_frames=50)
    chunks = run_talker(talker, state)
    assert sum(c.shape[0] for c in chunks) == 50
    assert talker.finish(state).finish_reason == "length"


@pytest.mark.parametrize(("fields", "field", "match"), [
    ({"voice": "clone"}, "voice", "cannot clone"),
    ({"has_reference": True}, "voice", "cannot clone"),
    ({"voice": "vivian"}, "voice", "unknown voice"),
    ({"text": "  "}, "input", "empty"),
    ({"max_new_frames": 0}, "max_new_tokens", "must be in"),
])
def test_the_talker_refuses_what_it_cannot_do(talker: PiperTalkerAdapter,
                                              fields: dict[str, object], field: str,
                                              match: str) -> None:
    with pytest.raises(InvalidInputError, match=match) as raised:
        start(talker, **fields)
    assert raised.value.field_name == field


def test_the_incremental_codec_equals_a_one_shot_decode(talker: PiperTalkerAdapter,
                                                        codec: PiperCodecAdapter) -> None:
    z = np.concatenate(run_talker(talker, start(talker)))
    one_shot = codec.decode(z)
    rng = np.random.default_rng(0)
    state = codec.prepare(EngineRequest("c", LatentDecodeInput()))
    pieces, sent = [], 0
    while True:  # frames arrive in random pieces of 1-19, as from any talker
        if sent < z.shape[0]:
            n = int(rng.integers(1, 20))
            codec.add_input(state, LatentFramesInput(z[sent:sent + n],
                                                     final=sent + n >= z.shape[0]))
            sent += n
        out = codec.step([state])[0]
        if out.partial is not None:
            pieces.append(out.partial)
        if out.finished:
            break
    streamed = np.concatenate(pieces)
    assert streamed.shape == one_shot.shape == (z.shape[0] * 256,)
    assert float(np.abs(streamed - one_shot).max()) <= 1e-5
    snr = 10 * np.log10(np.sum(one_shot**2) / np.sum((streamed - one_shot) ** 2))
    assert snr >= 100
    # Without right context the seams differ: the context is what makes it exact.
    naive = codec.prepare(EngineRequest("n", LatentDecodeInput(right_context_frames=0)))
    codec.add_input(naive, LatentFramesInput(z, final=True))
    rough = []
    while not (out := codec.step([naive])[0]).finished:
        rough.append(out.partial)
    rough.append(out.partial)
    assert float(np.abs(np.concatenate([r for r in rough if r is not None]) - one_shot).max()) \
        > 1e-3


def test_the_codec_refuses_malformed_latents(codec: PiperCodecAdapter) -> None:
    state = codec.prepare(EngineRequest("bad", LatentDecodeInput()))
    with pytest.raises(InvalidInputError, match="float32"):
        codec.add_input(state, LatentFramesInput(np.zeros((4, 80), np.float32)))
    with pytest.raises(InvalidInputError, match="NaN"):
        codec.add_input(state, LatentFramesInput(np.full((4, 192), np.nan, np.float32)))


def test_the_noise_bound_does_not_change_the_audio(talker: PiperTalkerAdapter,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    # The prior noise is drawn frames first, so a sentence that outruns a tight bound is run
    # again with a longer draw of the same generator and gets the same z.
    from stagemesh.services.talker import piper_adapter

    sentence = start(talker).sentences[0]
    roomy = talker.sentence_frames(sentence, seed=9, index=0)
    monkeypatch.setattr(piper_adapter, "_NOISE_FRAMES_PER_ID", 1)  # ~2.6 are needed
    with caplog.at_level("INFO", logger=piper_adapter.__name__):
        tight = talker.sentence_frames(sentence, seed=9, index=0)
    assert "drawing more" in caplog.text
    np.testing.assert_array_equal(tight, roomy)
