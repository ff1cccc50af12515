"""The Transcriber's numpy front end: the streaming resampler and Whisper's log-mel."""

from __future__ import annotations

import numpy as np
import pytest

from stagemesh.services.transcriber.frontend import log_mel
from stagemesh.shared.resample import StreamResampler


def tone(hz: float, rate: int, seconds: float) -> np.ndarray:
    return np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate).astype(np.float32)


@pytest.mark.parametrize("orig", [8_000, 22_050, 24_000, 48_000])
def test_streamed_resampling_equals_one_pass_and_keeps_a_tone(orig: int) -> None:
    signal = tone(440.0, orig, 1.0) + 0.3 * tone(3_000.0, orig, 1.0)
    whole = StreamResampler(orig, 16_000).push(signal, final=True)
    stream = StreamResampler(orig, 16_000)
    size = orig // 10 + 7  # chunks that do not line up with the ratio
    pieces = [stream.push(signal[i : i + size], final=i + size >= signal.shape[0])
              for i in range(0, signal.shape[0], size)]
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-6)
    assert abs(whole.shape[0] - 16_000) <= 1
    expected = tone(440.0, 16_000, 1.0) + 0.3 * tone(3_000.0, 16_000, 1.0)
    middle = slice(200, 15_800)  # away from the zero padding at both ends
    np.testing.assert_allclose(whole[middle], expected[middle], atol=0.01)


def test_resampling_removes_what_the_lower_rate_cannot_hold() -> None:
    """A 10 kHz tone at 24 kHz is above 16 kHz's Nyquist rate: it must not fold back in."""
    out = StreamResampler(24_000, 16_000).push(tone(10_000.0, 24_000, 1.0), final=True)
    assert float(np.abs(out[200:-200]).max()) < 0.01


def test_the_model_rate_passes_through() -> None:
    signal = tone(440.0, 16_000, 0.1)
    assert StreamResampler(16_000, 16_000).push(signal) is signal


@pytest.mark.parametrize("seconds", [0.005, 1.0, 12.3, 30.0, 31.0])
def test_log_mel_is_whispers_feature_extractor(seconds: float) -> None:
    from transformers import WhisperFeatureExtractor

    audio = np.random.default_rng(1).standard_normal(int(16_000 * seconds)).astype(np.float32)
    audio *= np.linspace(0.0, 0.5, audio.shape[0], dtype=np.float32)
    expected = WhisperFeatureExtractor(feature_size=80)(
        audio, sampling_rate=16_000, return_tensors="np").input_features[0]
    ours = log_mel(audio, 80)
    assert ours.shape == expected.shape == (80, 3000) and ours.flags.c_contiguous
    np.testing.assert_allclose(ours, expected, atol=1e-4)
