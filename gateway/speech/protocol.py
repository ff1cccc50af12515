"""A speech request: what the client asked (SpeechRequest), and what will run (SpeechParams).

The client's fields are read once into a SpeechRequest (from OpenAI JSON or the gRPC message);
`resolve_speech_request` checks every field against what the Talker and Codec publish (voices,
text and length limits, sampling ranges, reference clip limits) before any stage is called.
Each refusal names its field.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from stagemesh.gateway.core import random_seed
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.stages import SpeechFacts
from stagemesh.gateway.speech.audio import AudioFormat, ReferenceAudio, decode_reference
from stagemesh.gateway.wire.requests import MAX_BODY_BYTES, JsonFields, ref_audio_bytes
from stagemesh.shared.limits import CLONE_VOICE, DEFAULT_VOICE, MAX_SEED

#: OpenAI's accepted speed range; only 1.0 is served (see `_check_speed`).
MIN_SPEED, MAX_SPEED = 0.25, 4.0
#: Sampling defaults of a request that sets none.
DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K = 0.9, 1.0, 50
#: Smallest temperature other than 0 (0 = greedy): logits of any size stay finite when divided
#: by it (float32 holds 3e38; a logit over 3e36 does not occur), while 1e-40 overflows.
MIN_TEMPERATURE = 1e-2
#: POST /v1/audio/speech and SynthesizeSpeech may carry a reference clip (base64).
SPEECH_BODY_BYTES = MAX_BODY_BYTES


class SpeechTask(enum.StrEnum):
    CUSTOM_VOICE = "CustomVoice"  # a named voice of the model
    BASE = "Base"  # voice clone from ref_audio


@dataclass(frozen=True)
class SpeechRequest:
    """A speech request as the client sent it; None = not given."""

    input: str
    model: str = ""
    voice: str | None = None
    response_format: str | None = None
    speed: float | None = None
    task_type: str | None = None
    language: str | None = None
    instructions: str | None = None
    ref_audio: bytes | None = None  # the clip file's bytes (WAV, FLAC, ...)
    ref_text: str | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclass(frozen=True)
class SpeechParams:
    """A validated speech request (every field concrete)."""

    input: str
    #: Lower case: a voice of the model, DEFAULT_VOICE (the talker's default) or CLONE_VOICE.
    voice: str
    response_format: AudioFormat
    task_type: SpeechTask
    seed: int
    #: Upper bound on frames; 0 = the talker's default_max_new_frames.
    max_new_frames: int
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    language: str = ""
    instructions: str = ""
    reference: ReferenceAudio | None = None
    ref_text: str = ""


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidRequest(name, f"{name} must be in [{low:g}, {high:g}], got {value}")


def _check_temperature(temperature: float, high: float) -> None:
    """0 (greedy) or in [MIN_TEMPERATURE, high]: logits divided by a tinier temperature
    overflow to inf and the sampler's softmax turns them into NaN."""
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= high:
        raise InvalidRequest("temperature", f"temperature must be in [0, {high:g}] and 0 "
                             f"(greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}")


def _format(value: str | None) -> AudioFormat:
    try:
        return AudioFormat((value or AudioFormat.WAV.value).lower())
    except ValueError:
        raise InvalidRequest("response_format", f"response_format must be one of "
                             f"{[f.value for f in AudioFormat]}, got {value!r}") from None


def _task(value: str | None) -> SpeechTask:
    try:
        return SpeechTask(value or SpeechTask.CUSTOM_VOICE.value)
    except ValueError:
        raise InvalidRequest("task_type", f"task_type must be one of "
                             f"{[t.value for t in SpeechTask]}, got {value!r}") from None


def _check_speed(speed: float | None) -> None:
    if speed is None:
        return
    _check_range("speed", speed, MIN_SPEED, MAX_SPEED)
    if speed != 1.0:
        # Resampling would change pitch and a time-stretch would be a made-up effect on top of
        # the model; refuse rather than silently ignore.
        raise InvalidRequest("speed", f"speed {speed} is not supported by this model; only 1.0")


def _check_texts(request: SpeechRequest, facts: SpeechFacts) -> None:
    if not request.input.strip():
        raise InvalidRequest("input", "input must be a non-empty string")
    limits = (("input", request.input, facts.max_input_chars),
              ("language", request.language, facts.max_input_chars),
              ("instructions", request.instructions, facts.max_input_chars),
              ("ref_text", request.ref_text, facts.max_reference_text_chars))
    for name, text, limit in limits:
        if text is not None and len(text) > limit:
            raise InvalidRequest(name, f"{name} has {len(text)} characters, the limit is {limit}")


def _voice(voice: str | None, task: SpeechTask, facts: SpeechFacts) -> str:
    """The voice to ask the talker for: a known voice, DEFAULT_VOICE or CLONE_VOICE."""
    name = (voice or "").strip().lower()
    known = ", ".join(sorted(facts.voices))
    if task is SpeechTask.BASE:
        if name not in ("", CLONE_VOICE, *facts.voices):
            raise InvalidRequest("voice", f"unknown voice {voice!r}; use 'clone' or one of "
                                 f"[{known}]")
        return name or CLONE_VOICE
    if name == CLONE_VOICE:
        raise InvalidRequest("voice", "voice 'clone' needs task_type 'Base' and ref_audio")
    if name not in ("", DEFAULT_VOICE, *facts.voices):
        raise InvalidRequest("voice", f"unknown voice {voice!r}; known: [{known}]")
    return name or DEFAULT_VOICE


def _reference(request: SpeechRequest, task: SpeechTask,
               facts: SpeechFacts) -> ReferenceAudio | None:
    """The decoded clip of a voice clone (CPU work: resolve off the event loop)."""
    if task is not SpeechTask.BASE:
        if request.ref_audio is not None:
            raise InvalidRequest("ref_audio", "ref_audio is used only with task_type 'Base'")
        return None
    if not facts.supports_voice_clone:
        raise InvalidRequest("task_type", "this model cannot clone a voice (task_type 'Base')")
    if request.ref_audio is None:
        raise InvalidRequest("ref_audio", "task_type 'Base' (voice clone) needs ref_audio")
    return decode_reference(request.ref_audio, max_seconds=facts.max_reference_seconds,
                            sample_rates=facts.reference_sample_rates)


def _max_new_frames(value: int | None, facts: SpeechFacts) -> int:
    if value is None:
        return 0  # the talker's default_max_new_frames
    if not 1 <= value <= facts.max_new_frames:
        raise InvalidRequest("max_new_tokens", f"max_new_tokens must be in "
                             f"[1, {facts.max_new_frames}], got {value}")
    return value


def resolve_speech_request(request: SpeechRequest, facts: SpeechFacts) -> SpeechParams:
    """Check every field against the stages' published facts and fill the defaults."""
    _check_texts(request, facts)
    fmt = _format(request.response_format)
    _check_speed(request.speed)
    task = _task(request.task_type)
    reference = _reference(request, task, facts)
    max_new_frames = _max_new_frames(request.max_new_tokens, facts)
    seed = random_seed() if request.seed is None else request.seed
    _check_range("seed", seed, 0, MAX_SEED)
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    _check_temperature(temperature, facts.max_temperature)
    top_p = DEFAULT_TOP_P if request.top_p is None else request.top_p
    if not 0 < top_p <= 1:
        raise InvalidRequest("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = DEFAULT_TOP_K if request.top_k is None else request.top_k
    _check_range("top_k", top_k, 0, facts.max_top_k)
    return SpeechParams(
        input=request.input, voice=_voice(request.voice, task, facts), response_format=fmt,
        task_type=task, seed=seed, max_new_frames=max_new_frames, temperature=temperature,
        top_p=top_p, top_k=top_k,
        language=request.language or "", instructions=(request.instructions or "").strip(),
        reference=reference, ref_text=request.ref_text or "")


def speech_request(body: Mapping[str, object]) -> tuple[SpeechRequest, bool]:
    """POST /v1/audio/speech: OpenAI's fields plus the seed's extensions -> (request, stream)."""
    fields = JsonFields(body)
    stream_format = fields.string("stream_format")
    if stream_format not in (None, "audio"):
        raise InvalidRequest("stream_format", "only stream_format 'audio' is supported")
    ref_audio = fields.string("ref_audio")
    request = SpeechRequest(
        input=fields.string("input") or "", model=fields.string("model") or "",
        voice=fields.string("voice"), response_format=fields.string("response_format"),
        speed=fields.number("speed"), task_type=fields.string("task_type"),
        language=fields.string("language"), instructions=fields.string("instructions"),
        ref_audio=None if ref_audio is None else ref_audio_bytes(ref_audio),
        ref_text=fields.string("ref_text"), seed=fields.integer("seed"),
        max_new_tokens=fields.integer("max_new_tokens"),
        temperature=fields.number("temperature"), top_p=fields.number("top_p"),
        top_k=fields.integer("top_k"))
    return request, bool(fields.boolean("stream"))
