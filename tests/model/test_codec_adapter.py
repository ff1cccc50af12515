"""Codec adapters on the tiny Mimi: streamed decode equals one-shot decode; encode; limits;
validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stagemesh.models.speech import build_tiny_csm
from stagemesh.services.codec import csm_adapter as codec_adapter
from stagemesh.services.codec.csm_adapter import (
    REFERENCE_SAMPLE_RATES,
    CodecDecoderAdapter,
    CodecEncoderAdapter,
    CodecLimits,
    DecodeInput,
    DecodeState,
    EncodeInput,
    FramesInput,
    resample,
)
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError

#: Streamed vs one-shot, max abs sample difference (the tiny codec's audio peaks at about +-3):
#: measured ~1e-4 with the default 25-frame left context (float rounding in the decoder's
#: attention over a different window), ~1.3 without any context.
STREAM_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_csm(tmp_path_factory.mktemp("csm"))


@pytest.fixture(scope="module")
def decoder(model_dir: Path) -> CodecDecoderAdapter:
    return CodecDecoderAdapter(model_dir)


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> CodecEncoderAdapter:
    return CodecEncoderAdapter(model_dir)


def _codes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(seed))


def _start(decoder: CodecDecoderAdapter, payload: DecodeInput | None = None) -> DecodeState:
    payload = payload or DecodeInput()
    decoder.check_inputs(payload)
    return decoder.prepare(EngineRequest(request_id="d", payload=payload))


def _stream(
    decoder: CodecDecoderAdapter, codes: torch.Tensor, burst: int = 1, **params: int
) -> list[torch.Tensor]:
    """Feed `codes` in bursts, stepping until each burst is used up; return the chunks."""
    state = _start(decoder, DecodeInput(**params))
    chunks = []
    for lo in range(0, codes.shape[0], burst):
        decoder.add_input(
            state, FramesInput(codes[lo : lo + burst], final=lo + burst >= len(codes))
        )
        # A burst of n frames yields at most n chunks, then one step that waits or finishes.
        for _ in range(burst + 1):
            out = decoder.step([state])[0]
            if out.partial is not None:
                chunks.append(out.partial)
            if out.finished or out.waiting_for_input:
                break
        else:
            pytest.fail(f"the decoder neither waited nor finished within {burst + 1} steps")
    assert out.finished
    decoder.release(state)
    return chunks


def _one_shot(decoder: CodecDecoderAdapter, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return decoder._codec.decode(codes.T[None]).audio_values[0, 0]


def test_rates_come_from_the_config(decoder: CodecDecoderAdapter) -> None:
    assert decoder.sample_rate == 24_000
    assert decoder.samples_per_frame == 1920  # 12.5 Hz
    assert _one_shot(decoder, _codes(3)).shape == (3 * 1920,)


def test_limits_are_published(decoder: CodecDecoderAdapter, encoder: CodecEncoderAdapter) -> None:
    expected = CodecLimits(
        sample_rate=24_000,
        frame_rate=12.5,
        num_codebooks=8,
        max_reference_seconds=30.0,
        reference_sample_rates=(8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000),
    )
    assert encoder.limits == expected
    assert decoder.limits == expected


@pytest.fixture(scope="module")
def utterance(decoder: CodecDecoderAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """63 frames (about 5 s) and their one-shot decode."""
    codes = _codes(63)
    return codes, _one_shot(decoder, codes)


@pytest.mark.parametrize("burst", [1, 7])
def test_streamed_equals_one_shot(
    decoder: CodecDecoderAdapter, utterance: tuple[torch.Tensor, torch.Tensor], burst: int
) -> None:
    codes, full = utterance
    chunks = _stream(decoder, codes, burst=burst)
    # IC phase every 5 frames up to 25, then every 25, then the final flush of 13
    assert [c.shape[0] // 1920 for c in chunks] == [5, 5, 5, 5, 5, 25, 13]
    assert all(c.dtype == torch.float32 for c in chunks)
    streamed = torch.cat(chunks)
    assert streamed.shape == full.shape
    assert (streamed - full).abs().max() < STREAM_TOLERANCE


def test_without_left_context_the_seams_differ(
    decoder: CodecDecoderAdapter, utterance: tuple[torch.Tensor, torch.Tensor]
) -> None:
    codes, full = utterance
    streamed = torch.cat(_stream(decoder, codes, burst=63, left_context_frames=0))
    assert (streamed - full).abs().max() > 100 * STREAM_TOLERANCE


def test_waits_for_input_then_flushes_on_final(decoder: CodecDecoderAdapter) -> None:
    state = _start(decoder, DecodeInput(chunk_frames=4, initial_chunk_frames=2, frames=_codes(1)))
    out = decoder.step([state])[0]
    assert out.waiting_for_input and not out.finished and out.partial is None
    decoder.add_input(state, FramesInput(_codes(2, seed=1)))
    out = decoder.step([state])[0]
    assert out.partial.shape == (2 * 1920,) and out.step_index == 1 and not out.finished
    assert decoder.step([state])[0].waiting_for_input  # 3 frames: next boundary is 4
    decoder.add_input(state, FramesInput(torch.empty(0, 8, dtype=torch.long), final=True))
    out = decoder.step([state])[0]
    assert out.finished and out.partial.shape == (1920,) and out.step_index == 2
    result = decoder.finish(state)
    assert (result.num_frames, result.num_samples, result.sample_rate) == (3, 3 * 1920, 24_000)
    with pytest.raises(InvalidInputError) as info:
        decoder.add_input(state, FramesInput(_codes(1)))
    assert info.value.field_name == "frames"


def test_final_on_a_boundary_finishes_without_audio(decoder: CodecDecoderAdapter) -> None:
    state = _start(decoder, DecodeInput(initial_chunk_frames=2, frames=_codes(2)))
    assert decoder.step([state])[0].partial is not None
    decoder.add_input(state, FramesInput(torch.empty(0, 8, dtype=torch.long), final=True))
    out = decoder.step([state])[0]
    assert out.finished and out.partial is None and not out.waiting_for_input


def test_batched_states_match_separate_decodes(decoder: CodecDecoderAdapter) -> None:
    codes_a, codes_b = _codes(10, seed=1), _codes(10, seed=2)
    a = _start(decoder, DecodeInput(initial_chunk_frames=10, frames=codes_a, final=True))
    b = _start(decoder, DecodeInput(initial_chunk_frames=10, frames=codes_b, final=True))
    out_a, out_b = decoder.step([a, b])
    assert out_a.finished and out_b.finished
    assert (out_a.partial - _one_shot(decoder, codes_a)).abs().max() < STREAM_TOLERANCE
    assert (out_b.partial - _one_shot(decoder, codes_b)).abs().max() < STREAM_TOLERANCE


def test_only_the_left_context_is_kept(decoder: CodecDecoderAdapter) -> None:
    state = _start(
        decoder, DecodeInput(chunk_frames=10, initial_chunk_frames=5, left_context_frames=3)
    )
    for i in range(40):
        decoder.add_input(state, FramesInput(_codes(1, seed=i)))
        decoder.step([state])
        assert state.codes.shape[0] <= 3 + 10


# -- encode -------------------------------------------------------------------------------------


def _encode(encoder: CodecEncoderAdapter, payload: EncodeInput) -> torch.Tensor:
    encoder.check_inputs(payload)
    state = encoder.prepare(EngineRequest(request_id="e", payload=payload))
    out = encoder.step([state])[0]
    assert out.finished and out.step_index == 1
    codes = encoder.finish(state)
    encoder.release(state)
    return codes


def test_encode_then_decode_shapes(
    encoder: CodecEncoderAdapter, decoder: CodecDecoderAdapter
) -> None:
    audio = 0.3 * torch.randn(24_000, generator=torch.Generator().manual_seed(0))
    codes = _encode(encoder, EncodeInput(audio=audio, sample_rate=24_000))
    assert codes.dtype == torch.int64 and codes.shape == (13, 8)  # ceil(12.5) frames
    assert int(codes.min()) >= 0 and int(codes.max()) < 64
    decoded = torch.cat(_stream(decoder, codes))
    assert decoded.shape == (13 * 1920,)
    # the same second at 16 kHz ([1, samples] input) gives as many frames
    at_16k = resample(audio, 24_000, 16_000)[None]
    assert _encode(encoder, EncodeInput(audio=at_16k, sample_rate=16_000)).shape == (13, 8)


@pytest.mark.parametrize("rate", REFERENCE_SAMPLE_RATES)
def test_every_reference_rate_encodes_a_clip(encoder: CodecEncoderAdapter, rate: int) -> None:
    clip = 0.3 * torch.sin(2 * math.pi * 440 * torch.arange(rate) / rate)  # one second
    codes = _encode(encoder, EncodeInput(audio=clip, sample_rate=rate))
    assert codes.shape == (13, 8)  # one second at 12.5 Hz, whatever the input rate


@pytest.mark.parametrize("orig", [r for r in REFERENCE_SAMPLE_RATES if r != 24_000])
def test_resample_keeps_a_tone(orig: int) -> None:
    target = 24_000
    tone = torch.sin(2 * math.pi * 440 * torch.arange(orig) / orig)
    out = resample(tone, orig, target)
    assert out.shape == (target,) and out.dtype == torch.float32
    expected = torch.sin(2 * math.pi * 440 * torch.arange(target) / target)
    inner = slice(200, target - 200)  # the ends see the zero padding
    assert (out[inner] - expected[inner]).abs().max() < 2e-3


@pytest.mark.parametrize("orig", [44_100, 48_000, 8_000])
def test_resample_blocks_join_seamlessly(monkeypatch: pytest.MonkeyPatch, orig: int) -> None:
    """Memory is bounded by running the filter over blocks; the blocks change no sample."""
    clip = torch.randn(2 * orig + 17, generator=torch.Generator().manual_seed(orig))
    whole = resample(clip, orig, 24_000)
    monkeypatch.setattr(codec_adapter, "_BLOCK_ELEMENTS", 1000)  # dozens of blocks
    assert torch.equal(resample(clip, orig, 24_000), whole)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (DecodeInput(chunk_frames=0), "chunk_frames"),
        (DecodeInput(initial_chunk_frames=0), "initial_chunk_frames"),
        (DecodeInput(left_context_frames=-1), "left_context_frames"),
        (DecodeInput(frames=torch.zeros(3, 4, dtype=torch.long)), "frames"),
        (DecodeInput(frames=torch.zeros(3, 8)), "frames"),
        (DecodeInput(frames=torch.full((3, 8), 64)), "frames"),
        (DecodeInput(frames=torch.full((3, 8), -1)), "frames"),
        (DecodeInput(frames=torch.zeros(8000, 8, dtype=torch.long)), "frames"),
    ],
)
def test_decode_check_inputs(
    decoder: CodecDecoderAdapter, payload: DecodeInput, field: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        decoder.check_inputs(payload)
    assert info.value.field_name == field


@pytest.mark.parametrize(
    "payload",
    [
        EncodeInput(audio=torch.zeros(0), sample_rate=24_000),
        EncodeInput(audio=torch.zeros(31 * 24_000), sample_rate=24_000),
        EncodeInput(audio=torch.zeros(30 * 8_000 + 1), sample_rate=8_000),
        EncodeInput(audio=torch.zeros(2, 1000), sample_rate=24_000),
        EncodeInput(audio=torch.zeros(1000, dtype=torch.int16), sample_rate=24_000),
        EncodeInput(audio=torch.full((1000,), float("nan")), sample_rate=24_000),
        EncodeInput(audio=torch.zeros(1000), sample_rate=1_000),
        # in the old [8 kHz, 192 kHz] range, but not a listed reference rate
        EncodeInput(audio=torch.zeros(1000), sample_rate=44_000),
        EncodeInput(audio=torch.zeros(1000), sample_rate=96_000),
        EncodeInput(audio=torch.zeros(1000), sample_rate=0),
    ],
)
def test_encode_check_inputs(encoder: CodecEncoderAdapter, payload: EncodeInput) -> None:
    with pytest.raises(InvalidInputError) as info:
        encoder.check_inputs(payload)
    assert info.value.field_name == "ref_audio"
