"""Text-to-speech: validate parameters, then (Codec.encode for a clone) Talker -> Codec.

Frames flow while the talker is still generating: every `frames` event of the talker stream is
written at once as an `input` message on the codec stream, and every audio chunk the codec
emits goes out through `emit`. A failure of either call stops the other; a cancelled request
(client gone, cancel by id, deadline) stops both at their next step.

Audio encodings:
- wav, one-shot: a RIFF/WAVE file with its real sizes (16-bit PCM, mono);
- wav, streamed: the header goes first with its size fields at 0xFFFFFFFF ("unknown length",
  the convention streaming encoders such as ffmpeg use), then raw int16 chunks as produced;
- pcm: raw int16 little-endian mono, no header;
- flac: encoded by soundfile; FLAC needs the whole signal, so a streamed flac arrives as one
  piece at the end (the request still streams and is still cancellable).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import enum
import functools
import io
import logging
import random
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
from google.protobuf.message import Message

from stagemesh.gateway.cancel import CancelScope
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.events import Emit, Output
from stagemesh.gateway.recipes import Recipe
from stagemesh.gateway.stage_client import StubFor, call_stage
from stagemesh.shared.proto.v1 import codec_service_pb2, talker_service_pb2
from stagemesh.shared.tensors import array_from_proto, array_to_proto

log = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1
#: OpenAI's accepted speed range; only 1.0 is served (see `validate_speech_params`).
MIN_SPEED, MAX_SPEED = 0.25, 4.0
#: The talker generates this many frames unless the request says otherwise (20 s at 12.5 Hz).
DEFAULT_MAX_NEW_FRAMES = 250
MAX_REF_AUDIO_SECONDS = 30.0
#: The voice name that means "clone the reference audio".
CLONE_VOICE = "clone"
WAV_UNKNOWN_SIZE = 0xFFFFFFFF
_DATA_URL = re.compile(r"^data:([\w.+/-]*)(;[\w=.+-]+)*;base64,(.*)$", re.DOTALL)


class AudioFormat(enum.StrEnum):
    WAV = "wav"
    PCM = "pcm"
    FLAC = "flac"


#: Content-Type of each response format.
MEDIA_TYPES = {AudioFormat.WAV: "audio/wav", AudioFormat.PCM: "audio/pcm",
               AudioFormat.FLAC: "audio/flac"}


class SpeechTask(enum.StrEnum):
    CUSTOM_VOICE = "CustomVoice"  # a named voice of the model
    BASE = "Base"  # voice clone from ref_audio


@dataclass(frozen=True)
class ReferenceAudio:
    """A decoded reference clip: mono float32 samples."""

    samples: np.ndarray
    sample_rate: int


@dataclass(frozen=True)
class SpeechParams:
    """A validated speech request (every field concrete)."""

    input: str
    voice: str  # lower case; "" = the model's first voice, "clone" = the reference's
    response_format: AudioFormat
    task_type: SpeechTask
    seed: int
    max_new_frames: int
    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 50
    language: str = ""
    instructions: str = ""
    reference: ReferenceAudio | None = None
    ref_text: str = ""


# -- voices -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _voices_of_model(model: str) -> tuple[str, ...]:
    from stagemesh.models.registry import resolve_model
    from stagemesh.models.speech import load_voices

    return tuple(load_voices(Path(resolve_model(model))))


def recipe_voices(recipe: Recipe) -> list[str] | None:
    """The voice names of the recipe's model (from its voices.json), or None if the gateway
    cannot see the model folder (then the talker alone validates the voice)."""
    try:
        return list(_voices_of_model(recipe.model))
    except (OSError, ValueError, KeyError):
        log.warning("no voices.json reachable for recipe %s (model %s)", recipe.name,
                    recipe.model)
        return None


# -- validation ---------------------------------------------------------------------------------


def decode_ref_audio(data: bytes, max_bytes: int) -> ReferenceAudio:
    """Audio file bytes (WAV, FLAC, anything libsndfile reads) -> mono float32 samples."""
    if not data:
        raise InvalidRequest("ref_audio", "ref_audio is empty")
    if len(data) > max_bytes:
        raise InvalidRequest("ref_audio", f"ref_audio is {len(data)} bytes, the limit is "
                             f"{max_bytes}")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        raise InvalidRequest("ref_audio", f"ref_audio is not a readable audio file "
                             f"(WAV or FLAC): {error}") from None
    if samples.shape[0] == 0:
        raise InvalidRequest("ref_audio", "ref_audio has no samples")
    seconds = samples.shape[0] / rate
    if seconds > MAX_REF_AUDIO_SECONDS:
        raise InvalidRequest("ref_audio", f"ref_audio is {seconds:.1f} s long, the limit is "
                             f"{MAX_REF_AUDIO_SECONDS:.0f} s")
    if not np.isfinite(samples).all():
        raise InvalidRequest("ref_audio", "ref_audio contains NaN or infinite samples")
    return ReferenceAudio(samples=samples.mean(axis=1).astype(np.float32), sample_rate=rate)


def ref_audio_bytes(value: str) -> bytes:
    """A data URL (`data:audio/wav;base64,...`) or bare base64 -> the file's bytes.

    Remote URLs are refused: the gateway never fetches from the network on a client's behalf.
    """
    match = _DATA_URL.match(value.strip())
    if value.strip().startswith(("http://", "https://", "file:")):
        raise InvalidRequest("ref_audio", "ref_audio must be a data URL or base64, not a URL")
    payload = match.group(3) if match else value
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("ref_audio", "ref_audio is not valid base64") from None


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidRequest(name, f"{name} must be in [{low}, {high}], got {value}")


def _resolve_voice(voice: str | None, task: SpeechTask, known: list[str] | None,
                   default: str) -> str:
    name = (voice or "").strip().lower()
    if task is SpeechTask.BASE:
        if name not in ("", CLONE_VOICE) and known is not None and name not in known:
            raise InvalidRequest("voice", f"unknown voice {voice!r}; use 'clone' or one of "
                                 f"{sorted(known)}")
        return name or CLONE_VOICE
    name = name or default.lower()
    if name == CLONE_VOICE:
        raise InvalidRequest("voice", "voice 'clone' needs task_type 'Base' and ref_audio")
    if name and known is not None and name not in known:
        raise InvalidRequest("voice", f"unknown voice {voice!r}; known: {sorted(known)}")
    return name


def validate_speech_params(
    recipe: Recipe,
    *,
    input: str | None,
    voices: list[str] | None = None,
    voice: str | None = None,
    response_format: str | None = None,
    speed: float | None = None,
    task_type: str | None = None,
    language: str | None = None,
    instructions: str | None = None,
    ref_audio: bytes | None = None,
    ref_text: str | None = None,
    seed: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
) -> SpeechParams:
    """Fill defaults from the recipe and check every field before any stage is called."""
    limits = recipe.speech_limits
    if not isinstance(input, str) or not input.strip():
        raise InvalidRequest("input", "input must be a non-empty string")
    if len(input) > limits.max_input_chars:
        raise InvalidRequest("input", f"input has {len(input)} characters, the limit is "
                             f"{limits.max_input_chars}")
    try:
        fmt = AudioFormat((response_format or AudioFormat.WAV.value).lower())
    except ValueError:
        raise InvalidRequest("response_format", f"response_format must be one of "
                             f"{[f.value for f in AudioFormat]}, got {response_format!r}") from None
    if speed is not None:
        _check_range("speed", speed, MIN_SPEED, MAX_SPEED)
        if speed != 1.0:
            # Resampling would change pitch and a time-stretch would be a made-up effect on
            # top of the model; refuse rather than silently ignore.
            raise InvalidRequest("speed", f"speed {speed} is not supported by this model; "
                                 "only 1.0")
    try:
        task = SpeechTask(task_type or SpeechTask.CUSTOM_VOICE.value)
    except ValueError:
        raise InvalidRequest("task_type", f"task_type must be one of "
                             f"{[t.value for t in SpeechTask]}, got {task_type!r}") from None
    for name, text in (("language", language), ("instructions", instructions),
                       ("ref_text", ref_text)):
        if text is not None and len(text) > limits.max_input_chars:
            raise InvalidRequest(name, f"{name} is longer than {limits.max_input_chars} "
                                 "characters")
    reference = None
    if task is SpeechTask.BASE:
        if ref_audio is None:
            raise InvalidRequest("ref_audio", "task_type 'Base' (voice clone) needs ref_audio")
        reference = decode_ref_audio(ref_audio, limits.max_ref_audio_bytes)
    elif ref_audio is not None:
        raise InvalidRequest("ref_audio", "ref_audio is used only with task_type 'Base'")
    frames = DEFAULT_MAX_NEW_FRAMES if max_new_tokens is None else max_new_tokens
    if not 1 <= frames <= limits.max_new_frames:
        raise InvalidRequest("max_new_tokens", f"max_new_tokens must be in "
                             f"[1, {limits.max_new_frames}], got {frames}")
    seed = random.randrange(2**31) if seed is None else seed
    _check_range("seed", seed, 0, MAX_SEED)
    temperature = 0.9 if temperature is None else float(temperature)
    _check_range("temperature", temperature, 0.0, 10.0)
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0 < top_p <= 1:
        raise InvalidRequest("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = 50 if top_k is None else top_k
    _check_range("top_k", top_k, 0, 10_000)
    return SpeechParams(
        input=input, voice=_resolve_voice(voice, task, voices, recipe.default_voice),
        response_format=fmt, task_type=task, seed=seed, max_new_frames=frames,
        temperature=temperature, top_p=top_p, top_k=top_k, language=language or "",
        instructions=(instructions or "").strip(), reference=reference, ref_text=ref_text or "")


# -- encoding -------------------------------------------------------------------------------------


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] -> int16 (clipped, rounded)."""
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2")


def wav_header(sample_rate: int, data_bytes: int = WAV_UNKNOWN_SIZE) -> bytes:
    """A 44-byte RIFF/WAVE header for 16-bit mono PCM; sizes 0xFFFFFFFF = unknown length."""
    riff = WAV_UNKNOWN_SIZE if data_bytes == WAV_UNKNOWN_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def encode_audio(pcm: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
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
        self._held: list[np.ndarray] = []  # flac only

    def chunk(self, pcm: np.ndarray) -> bytes:
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


# -- the pipeline -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioPiece:
    """One decoded chunk, in order: mono float32 samples."""

    pcm: np.ndarray
    sample_rate: int


@dataclass(frozen=True)
class SpeechSummary:
    frames: int
    samples: int
    sample_rate: int
    finish_reason: str


async def _encode_reference(scope: CancelScope, codec: Any,
                            reference: ReferenceAudio) -> Message:
    encoded = await call_stage(
        scope, "codec", codec.EncodeAudio,
        codec_service_pb2.EncodeAudioRequest,
        codec_service_pb2.EncodeAudioStart(
            request_id=scope.request_id, pcm=array_to_proto(reference.samples),
            sample_rate=reference.sample_rate))
    return encoded.codes


def _talker_start(scope: CancelScope, params: SpeechParams,
                  reference_codes: Message | None) -> talker_service_pb2.GenerateFramesStart:
    start = talker_service_pb2.GenerateFramesStart(
        request_id=scope.request_id, text=params.input, voice=params.voice,
        sampling=talker_service_pb2.SamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seed=params.seed, max_new_frames=params.max_new_frames),
        instructions=params.instructions, language=params.language)
    if reference_codes is not None:
        start.reference_codes.CopyFrom(reference_codes)
        start.reference_text = params.ref_text
    return start


async def synthesize(recipe: Recipe, params: SpeechParams, scope: CancelScope, stubs: StubFor,
                     emit: Emit) -> SpeechSummary:
    """(Codec.encode) -> Talker -> Codec; emits an Output(AudioPiece) per decoded chunk."""
    talker, codec = stubs("talker"), stubs("codec")
    reference_codes = None
    if params.reference is not None:
        reference_codes = await _encode_reference(scope, codec, params.reference)
    frames: asyncio.Queue[Message | None] = asyncio.Queue()

    async def on_talker_event(stage: str, response: Message) -> None:
        if response.WhichOneof("event") == "frames":
            frames.put_nowait(response.frames.codes)

    async def pump_frames(call: Any) -> None:
        # Frames go to the codec as they come; None marks the talker's successful end.
        write = call.write
        while (codes := await frames.get()) is not None:
            await write(codec_service_pb2.DecodeAudioRequest(
                input=codec_service_pb2.DecodeAudioInput(codes=codes)))
        await write(codec_service_pb2.DecodeAudioRequest(
            input=codec_service_pb2.DecodeAudioInput(final=True)))

    async def on_codec_event(stage: str, response: Message) -> None:
        if response.WhichOneof("event") == "chunk":
            scope.check()  # cancelled by id between the two calls' registrations
            chunk = response.chunk
            await emit(Output(AudioPiece(array_from_proto(chunk.pcm), chunk.sample_rate)))

    async def run_talker() -> Message:
        result = await call_stage(scope, "talker", talker.GenerateFrames,
                                  talker_service_pb2.GenerateFramesRequest,
                                  _talker_start(scope, params, reference_codes),
                                  on_event=on_talker_event)
        frames.put_nowait(None)
        return result

    async def run_codec() -> Message:
        return await call_stage(scope, "codec", codec.DecodeAudio,
                                codec_service_pb2.DecodeAudioRequest,
                                codec_service_pb2.DecodeAudioStart(request_id=scope.request_id),
                                on_event=on_codec_event, pump_inputs=pump_frames)

    try:
        async with asyncio.TaskGroup() as group:
            talker_task = group.create_task(run_talker())
            codec_task = group.create_task(run_codec())
    except ExceptionGroup as failed:
        # The first failure cancelled the other call; report that failure, not the group.
        raise failed.exceptions[0] from None
    talked, decoded = talker_task.result(), codec_task.result()
    return SpeechSummary(frames=talked.total_frames, samples=decoded.total_samples,
                         sample_rate=decoded.sample_rate, finish_reason=talked.finish_reason)


async def synthesize_all(recipe: Recipe, params: SpeechParams, scope: CancelScope,
                         stubs: StubFor) -> tuple[bytes, SpeechSummary]:
    """The whole utterance, encoded in the requested format (one-shot responses)."""
    pieces: list[AudioPiece] = []

    async def keep(item: object) -> None:
        if isinstance(item, Output):
            pieces.append(item.value)

    summary = await synthesize(recipe, params, scope, stubs, keep)
    pcm = np.concatenate([p.pcm for p in pieces]) if pieces else np.zeros(0, np.float32)
    encoded = await asyncio.to_thread(encode_audio, pcm, summary.sample_rate,
                                      params.response_format)
    return encoded, summary
