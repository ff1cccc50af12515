"""Audio bytes: response formats (WAV, PCM, FLAC), the streaming encoder, reference clips.

Encodings:
- wav, one-shot: a RIFF/WAVE file with its real sizes (16-bit PCM, mono);
- wav, streamed: the header goes first with its size fields at 0xFFFFFFFF ("unknown length",
  the convention streaming encoders such as ffmpeg use), then raw int16 chunks as produced;
- pcm: raw int16 little-endian mono, no header;
- flac: encoded by soundfile; FLAC needs the whole signal, so a streamed flac arrives as one
  piece at the end (the request still streams and is still cancellable).
"""

from __future__ import annotations

import enum
import io
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import soundfile

from stagemesh.gateway.errors import InvalidRequest

WAV_UNKNOWN_SIZE = 0xFFFFFFFF
WAV_HEADER_BYTES = 44

Samples = npt.NDArray[np.float32]


class AudioFormat(enum.StrEnum):
    WAV = "wav"
    PCM = "pcm"
    FLAC = "flac"


#: Content-Type of each response format.
MEDIA_TYPES: dict[AudioFormat, str] = {AudioFormat.WAV: "audio/wav",
                                       AudioFormat.PCM: "audio/pcm",
                                       AudioFormat.FLAC: "audio/flac"}


def to_int16(pcm: npt.NDArray[np.floating]) -> npt.NDArray[np.int16]:
    """float samples in [-1, 1] -> little-endian int16 (clipped, rounded)."""
    scaled: npt.NDArray[np.float64] = np.clip(pcm, -1.0, 1.0) * 32767
    return np.round(scaled).astype(np.dtype("<i2"))


def wav_header(sample_rate: int, data_bytes: int = WAV_UNKNOWN_SIZE) -> bytes:
    """A 44-byte RIFF/WAVE header for 16-bit mono PCM; sizes 0xFFFFFFFF = unknown length."""
    riff = WAV_UNKNOWN_SIZE if data_bytes == WAV_UNKNOWN_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def encode_audio(pcm: npt.NDArray[np.floating], sample_rate: int, fmt: AudioFormat) -> bytes:
    """A whole utterance in the requested format (one-shot responses)."""
    samples = to_int16(pcm)
    if fmt is AudioFormat.PCM:
        return samples.tobytes()
    if fmt is AudioFormat.WAV:
        return wav_header(sample_rate, samples.nbytes) + samples.tobytes()
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, sample_rate, format="FLAC", subtype="PCM_16")
    return buffer.getvalue()


class StreamEncoder:
    """Audio bytes as chunks arrive: `chunk()` for each, then `end()` (see the module doc)."""

    def __init__(self, fmt: AudioFormat, sample_rate: int) -> None:
        self.fmt = fmt
        self.sample_rate = sample_rate
        self._started = False
        self._held: list[npt.NDArray[np.floating]] = []  # flac only

    def chunk(self, pcm: npt.NDArray[np.floating]) -> bytes:
        if self.fmt is AudioFormat.FLAC:
            self._held.append(pcm)
            return b""
        head = b""
        if not self._started and self.fmt is AudioFormat.WAV:
            head = wav_header(self.sample_rate)
        self._started = True
        return head + to_int16(pcm).tobytes()

    def end(self) -> bytes:
        if self.fmt is AudioFormat.FLAC:
            pcm = np.concatenate(self._held) if self._held else np.zeros(0, np.float32)
            return encode_audio(pcm, self.sample_rate, self.fmt)
        if not self._started and self.fmt is AudioFormat.WAV:
            return wav_header(self.sample_rate, 0)  # no audio at all: an empty, valid WAV
        return b""


@dataclass(frozen=True)
class ReferenceAudio:
    """A decoded reference clip: mono float32 samples."""

    samples: Samples
    sample_rate: int


def decode_reference(data: bytes, *, max_seconds: float,
                     sample_rates: tuple[int, ...]) -> ReferenceAudio:
    """Audio file bytes (WAV, FLAC, anything libsndfile reads) -> mono float32 samples.

    The limits are the codec's (it encodes the clip): at most `max_seconds` long, at one of
    `sample_rates`. Every refusal names `ref_audio`.
    """
    if not data:
        raise InvalidRequest("ref_audio", "ref_audio is empty")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as clip:
            rate, frames = int(clip.samplerate), int(clip.frames)
            if rate not in sample_rates:
                raise InvalidRequest("ref_audio", f"ref_audio has a sample rate of {rate} Hz; "
                                     f"accepted: {list(sample_rates)}")
            if frames / rate > max_seconds:
                raise InvalidRequest("ref_audio", f"ref_audio is {frames / rate:.1f} s long, the "
                                     f"limit is {max_seconds:g} s")
            samples = clip.read(dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        raise InvalidRequest("ref_audio", f"ref_audio is not a readable audio file "
                             f"(WAV or FLAC): {error}") from None
    if samples.shape[0] == 0:
        raise InvalidRequest("ref_audio", "ref_audio has no samples")
    if not np.isfinite(samples).all():
        raise InvalidRequest("ref_audio", "ref_audio contains NaN or infinite samples")
    return ReferenceAudio(samples=samples.mean(axis=1).astype(np.float32), sample_rate=rate)
