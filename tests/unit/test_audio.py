"""Audio framing: WAV headers (one-shot and streamed), raw PCM, FLAC at the end, int16."""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile

from stagemesh.gateway.speech.audio import (
    WAV_HEADER_BYTES,
    WAV_UNKNOWN_SIZE,
    AudioFormat,
    StreamEncoder,
    encode_audio,
    to_int16,
    wav_header,
)

RATE = 24_000


def ramp(samples: int) -> np.ndarray:
    return np.linspace(-0.5, 0.5, samples, dtype=np.float32)


def test_int16_is_rounded_clipped_and_little_endian() -> None:
    samples = to_int16(np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, 1e-5], dtype=np.float32))
    assert samples.dtype == np.dtype("<i2")
    assert samples.tolist() == [0, 32767, -32767, 32767, -32767, 16384, 0]


def test_a_wav_header_states_its_sizes() -> None:
    header = wav_header(RATE, 1000)
    assert len(header) == WAV_HEADER_BYTES
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt " and header[36:40] == b"data"
    riff, = struct.unpack("<I", header[4:8])
    fmt_size, pcm, channels, rate, byte_rate, align, bits = struct.unpack("<IHHIIHH",
                                                                         header[16:36])
    assert riff == 36 + 1000 and struct.unpack("<I", header[40:44]) == (1000,)
    assert (fmt_size, pcm, channels, rate, byte_rate, align, bits) == (16, 1, 1, RATE,
                                                                       RATE * 2, 2, 16)


def test_a_streamed_wav_header_says_unknown_length() -> None:
    header = wav_header(RATE)
    assert struct.unpack("<I", header[4:8]) == (WAV_UNKNOWN_SIZE,)
    assert struct.unpack("<I", header[40:44]) == (WAV_UNKNOWN_SIZE,)


def test_a_one_shot_wav_is_read_back_by_libsndfile() -> None:
    pcm = ramp(480)
    data = encode_audio(pcm, RATE, AudioFormat.WAV)
    assert len(data) == WAV_HEADER_BYTES + 480 * 2
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and np.array_equal(samples, to_int16(pcm))


def test_pcm_is_the_wav_without_its_header() -> None:
    pcm = ramp(100)
    assert encode_audio(pcm, RATE, AudioFormat.PCM) == encode_audio(
        pcm, RATE, AudioFormat.WAV)[WAV_HEADER_BYTES:]


def test_streamed_wav_is_the_header_once_then_each_chunk() -> None:
    encoder = StreamEncoder(AudioFormat.WAV, RATE)
    first, second = encoder.chunk(ramp(10)), encoder.chunk(ramp(20))
    assert first == wav_header(RATE) + to_int16(ramp(10)).tobytes()
    assert second == to_int16(ramp(20)).tobytes()
    assert encoder.end() == b""


def test_streamed_pcm_has_no_header() -> None:
    encoder = StreamEncoder(AudioFormat.PCM, RATE)
    assert encoder.chunk(ramp(10)) == to_int16(ramp(10)).tobytes()
    assert encoder.end() == b""


def test_a_stream_without_audio_still_ends_as_a_valid_empty_wav() -> None:
    ended = StreamEncoder(AudioFormat.WAV, RATE).end()
    assert ended == wav_header(RATE, 0)
    assert soundfile.info(io.BytesIO(ended)).frames == 0


def test_streamed_flac_arrives_whole_at_the_end() -> None:
    chunks = [ramp(300), ramp(200)]
    encoder = StreamEncoder(AudioFormat.FLAC, RATE)
    assert [encoder.chunk(chunk) for chunk in chunks] == [b"", b""]
    flac = encoder.end()
    assert flac[:4] == b"fLaC"
    samples, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    assert rate == RATE and np.array_equal(samples, to_int16(np.concatenate(chunks)))
    assert flac == encode_audio(np.concatenate(chunks), RATE, AudioFormat.FLAC)
