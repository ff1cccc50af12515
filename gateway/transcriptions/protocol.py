"""A transcription request: OpenAI's `POST /v1/audio/transcriptions` form -> the records the
pipeline runs on, and the transcript -> each of OpenAI's response formats.

The form's shape is checked here; limits (sample rates, languages, length) are checked against
what the transcriber publishes when the request is prepared (pipeline.py). Every refusal names
its field. Uploads are decoded by libsndfile (WAV, FLAC, OGG, and MP3 through its LGPL mpg123:
no GPL decoder is involved).
"""

from __future__ import annotations

import base64
import binascii
import enum
import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import soundfile

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.wire.forms import Form, FormFields

Samples = npt.NDArray[np.float32]

#: Every field the route reads; any other is a 400 naming it. The openai SDK sends a list as
#: `name[]` parts.
TRANSCRIPTION_FIELDS = frozenset({
    "file", "model", "language", "prompt", "response_format", "temperature", "stream",
    "timestamp_granularities", "timestamp_granularities[]", "timeout"})


class ResponseFormat(enum.StrEnum):
    JSON = "json"
    TEXT = "text"
    VERBOSE_JSON = "verbose_json"
    SRT = "srt"
    VTT = "vtt"


#: The formats a streamed transcription can take (OpenAI's rule: the rest need whole segments).
STREAM_FORMATS = frozenset({ResponseFormat.JSON, ResponseFormat.TEXT})
#: What `language` means in verbose_json (Whisper's names; the model's languages are codes).
LANGUAGE_NAMES = {"en": "english"}


@dataclass(frozen=True)
class DecodedAudio:
    """An upload decoded to mono float32 samples at its own rate."""

    samples: Samples
    sample_rate: int

    @property
    def seconds(self) -> float:
        return int(self.samples.shape[0]) / self.sample_rate


@dataclass(frozen=True)
class TranscriptionRequest:
    audio: bytes
    model: str = ""
    language: str = ""  # "" = the model's default
    prompt: str = ""
    response_format: ResponseFormat = ResponseFormat.JSON
    stream: bool = False


@dataclass(frozen=True)
class Segment:
    """A final transcript segment, as the transcriber closed it."""

    index: int
    text: str
    start_ms: int
    end_ms: int
    no_speech_prob: float = 0.0


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: tuple[Segment, ...]
    seconds: float  # the audio's length
    language: str


def _granularities(form: Form) -> None:
    """Segment timestamps are what the stage gives; word timestamps are a 400."""
    for name in ("timestamp_granularities", "timestamp_granularities[]"):
        for value in form.fields.get(name, []):
            if value == "word":
                raise InvalidRequest("timestamp_granularities",
                                     "word timestamps are not produced (the transcriber gives "
                                     "segment timestamps); use ['segment']")
            if value != "segment":
                raise InvalidRequest("timestamp_granularities", "timestamp_granularities "
                                     f"takes 'segment', got {value[:40]!r}")


def _response_format(text: str | None) -> ResponseFormat:
    try:
        return ResponseFormat(text or "json")
    except ValueError:
        raise InvalidRequest("response_format", f"response_format must be one of "
                             f"{[f.value for f in ResponseFormat]}, got {text!r}") from None


def transcription_request(form: Form) -> TranscriptionRequest:
    """The transcription form -> the request (nothing decoded yet)."""
    form.refuse_unknown(set(TRANSCRIPTION_FIELDS))
    fields = FormFields(form)
    files = form.file_list("file")
    if len(files) != 1:
        raise InvalidRequest("file", "send one audio file as the multipart part `file`")
    fmt = _response_format(fields.string("response_format"))
    stream = fields.boolean("stream")
    if stream and fmt not in STREAM_FORMATS:
        raise InvalidRequest("stream", f"response_format {fmt.value} cannot be streamed; "
                             "stream json or text")
    _granularities(form)
    if fields.number("temperature") not in (None, 0.0):
        raise InvalidRequest("temperature", "only temperature 0 (greedy decoding) is supported")
    return TranscriptionRequest(audio=files[0].data, model=fields.string("model") or "",
                                language=(fields.string("language") or "").strip().lower(),
                                prompt=fields.string("prompt") or "", response_format=fmt,
                                stream=stream)


def decode_audio(data: bytes, field: str) -> DecodedAudio:
    """Audio file bytes (WAV, MP3, FLAC, OGG) -> mono float32; a 400 naming `field` if it is
    not readable audio."""
    if not data:
        raise InvalidRequest(field, f"{field} is empty")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        raise InvalidRequest(field, f"{field} is not a readable audio file (WAV, MP3, FLAC or "
                             f"OGG): {error}") from None
    if samples.shape[0] == 0:
        raise InvalidRequest(field, f"{field} has no samples")
    if not np.isfinite(samples).all():
        raise InvalidRequest(field, f"{field} contains NaN or infinite samples")
    return DecodedAudio(np.ascontiguousarray(samples.mean(axis=1), np.float32), int(rate))


def decode_base64_audio(data: str, field: str) -> DecodedAudio:
    """Base64 audio (chat's `input_audio.data`) -> mono float32; 400s name `field`.data or
    `field`."""
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{field}.data", f"{field}.data is not valid base64") from None
    return decode_audio(raw, field)


# -- the answers ----------------------------------------------------------------------------


def _clock(ms: int, separator: str) -> str:
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{millis:03d}"


def _cues(segments: Sequence[Segment], separator: str) -> list[str]:
    return [f"{_clock(s.start_ms, separator)} --> {_clock(s.end_ms, separator)}\n{s.text.strip()}"
            for s in segments]


def srt(segments: Sequence[Segment]) -> str:
    return "".join(f"{i}\n{cue}\n\n" for i, cue in enumerate(_cues(segments, ","), start=1))


def vtt(segments: Sequence[Segment]) -> str:
    return "WEBVTT\n\n" + "".join(f"{cue}\n\n" for cue in _cues(segments, "."))


def usage(seconds: float) -> dict[str, object]:
    """OpenAI's duration usage of a transcription (whole seconds, rounded up)."""
    return {"type": "duration", "seconds": int(np.ceil(seconds))}


def verbose_json(transcript: Transcript) -> dict[str, object]:
    return {
        "task": "transcribe",
        "language": LANGUAGE_NAMES.get(transcript.language, transcript.language),
        "duration": round(transcript.seconds, 3), "text": transcript.text,
        "segments": [{"id": s.index, "seek": 0, "start": s.start_ms / 1000,
                      "end": s.end_ms / 1000, "text": s.text, "tokens": [],
                      "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 0.0,
                      "no_speech_prob": s.no_speech_prob} for s in transcript.segments],
        "usage": usage(transcript.seconds),
    }
