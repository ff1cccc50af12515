"""OpenAI's GA Realtime protocol, the subset a voice client needs: client events parsed into
records (every refusal an `error` event naming the bad field), server events built as dicts.

Names follow the openai SDK's `types/realtime` (GA, not the beta's): `session.audio.input.
format` {type: "audio/pcm", rate: 24000}, `response.output_audio.delta`, `conversation.item.
added` / `done`. Only PCM16 mono at 24 kHz is spoken both ways; the mesh resamples to and from
its stages' own rates.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

import numpy as np
import numpy.typing as npt

from stagemesh.gateway.speech.audio import to_int16
from stagemesh.gateway.wire.requests import JsonObject

#: The one audio format, both ways: 16-bit little-endian PCM, mono, 24 kHz.
PCM_TYPE: Final = "audio/pcm"
PCM_RATE: Final = 24_000
PCM_BYTES_PER_SAMPLE: Final = 2
#: The most audio one `input_audio_buffer.append` may carry (base64 characters: 10 s).
MAX_APPEND_SECONDS: Final = 10
MAX_APPEND_CHARS: Final = 4 * (MAX_APPEND_SECONDS * PCM_RATE * PCM_BYTES_PER_SAMPLE + 2) // 3
#: The most any other client event may carry, in characters of JSON.
MAX_EVENT_CHARS: Final = 256 * 1024
#: The WebSocket's own message limit (a larger message closes the socket with 1009): above
#: both, so that an oversized event is answered by an `error` event naming its field.
WS_MAX_BYTES: Final = 2 * MAX_APPEND_CHARS
#: The longest text of a conversation item, a session's instructions, an id.
MAX_TEXT_CHARS: Final = 64 * 1024
MAX_ID_CHARS: Final = 64
#: The session's turn detection defaults (OpenAI's: 500 ms of silence, threshold 0.5).
DEFAULT_SILENCE_MS: Final = 500
MAX_SILENCE_MS: Final = 10_000

Pcm16 = npt.NDArray[np.int16]


@dataclass(frozen=True)
class RealtimeLimits:
    """What an operator bounds on `GET /v1/realtime` (`stagemesh serve` / `gateway` flags
    `--realtime-max-sessions`, `--realtime-idle-timeout`, `--realtime-max-buffer-seconds`).
    The per-event sizes above are the protocol's own (an append is one Transcriber input, at
    most its 10 s), not options."""

    #: Sessions open at once; None: as many as the recipe's Transcriber holds at once.
    max_sessions: int | None = None
    #: A session with no client event for this long, while no answer plays, is closed.
    idle_timeout_s: float = 120.0
    #: Audio a client may buffer before a commit, with turn detection off.
    max_buffer_seconds: float = 600.0

    def __post_init__(self) -> None:
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError(f"realtime max_sessions must be at least 1, got "
                             f"{self.max_sessions}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"realtime idle timeout must be positive, got "
                             f"{self.idle_timeout_s}")
        if not self.max_buffer_seconds > 0:
            raise ValueError(f"realtime max buffer seconds must be positive, got "
                             f"{self.max_buffer_seconds}")


def new_id(prefix: str) -> str:
    """An id of OpenAI's shape (`item_...`, `resp_...`, `event_...`), within MAX_ID_CHARS."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class RealtimeError(Exception):
    """A client event the session refuses: sent as an `error` event, the session goes on."""

    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_value", event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.event_id = message, param, code, event_id

    def event(self) -> JsonObject:
        return server_event("error", error={
            "type": "invalid_request_error", "code": self.code, "message": self.message,
            "param": self.param, "event_id": self.event_id})


def server_event(kind: str, **fields: object) -> JsonObject:
    return {"type": kind, "event_id": new_id("event"), **fields}


# -- the session's settings -----------------------------------------------------------------


@dataclass(frozen=True)
class ServerVad:
    """`turn_detection: {type: "server_vad"}`: the Transcriber stage's VAD ends turns."""

    silence_duration_ms: int = DEFAULT_SILENCE_MS
    threshold: float = 0.0  # 0 = the stage's default
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(frozen=True)
class SessionConfig:
    instructions: str = ""
    voice: str | None = None  # None = the speech recipe's default voice
    turn_detection: ServerVad | None = ServerVad()
    max_output_tokens: int | None = None  # None = the thinker's default


def session_object(session_id: str, model: str, config: SessionConfig) -> JsonObject:
    """The `session` of session.created / session.updated (RealtimeSessionCreateRequest)."""
    pcm: JsonObject = {"type": PCM_TYPE, "rate": PCM_RATE}
    vad = config.turn_detection
    turn_detection = None if vad is None else {
        "type": "server_vad", "silence_duration_ms": vad.silence_duration_ms,
        "threshold": vad.threshold or None, "create_response": vad.create_response,
        "interrupt_response": vad.interrupt_response}
    return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
            "output_modalities": ["audio"], "instructions": config.instructions,
            "max_output_tokens": config.max_output_tokens or "inf",
            "audio": {"input": {"format": pcm, "turn_detection": turn_detection,
                                "transcription": {"model": "stagemesh-listener"}},
                      "output": {"format": pcm, "voice": config.voice or "default"}}}


# -- client events --------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionUpdate:
    config: SessionConfig


@dataclass(frozen=True)
class Append:
    pcm: Pcm16


@dataclass(frozen=True)
class Commit:
    pass


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class ItemCreate:
    role: str  # "user", "assistant" or "system"
    text: str
    item_id: str | None
    previous_item_id: str | None


@dataclass(frozen=True)
class Truncate:
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True)
class ResponseCreate:
    instructions: str | None
    max_output_tokens: int | None


@dataclass(frozen=True)
class ResponseCancel:
    response_id: str | None


ClientEvent: TypeAlias = (SessionUpdate | Append | Commit | Clear | ItemCreate | Truncate
                          | ResponseCreate | ResponseCancel)


@dataclass(frozen=True)
class Parsed:
    event: ClientEvent
    event_id: str | None


class _Fields:
    """Typed reads of one JSON object, each refusal naming its field's full path."""

    def __init__(self, body: object, path: str, event_id: str | None) -> None:
        self.path, self.event_id = path, event_id
        if not isinstance(body, dict):
            raise RealtimeError(f"{path or 'the event'} must be an object", path or None,
                                event_id=event_id)
        self.body: dict[str, object] = body

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def refuse(self, param: str, message: str) -> RealtimeError:
        return RealtimeError(message, param, event_id=self.event_id)

    def has(self, key: str) -> bool:
        return key in self.body

    def obj(self, key: str) -> _Fields | None:
        value = self.body.get(key)
        return None if value is None else _Fields(value, self.name(key), self.event_id)

    def string(self, key: str, limit: int = MAX_TEXT_CHARS) -> str | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.refuse(self.name(key), f"{self.name(key)} must be a string")
        if len(value) > limit:
            raise self.refuse(self.name(key), f"{self.name(key)} has {len(value)} characters; "
                              f"the limit is {limit}")
        return value

    def integer(self, key: str, low: int, high: int) -> int | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.refuse(self.name(key), f"{self.name(key)} must be an integer in "
                              f"[{low}, {high}]")
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.body.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.refuse(self.name(key), f"{self.name(key)} must be a boolean")
        return value


def parse_client_event(raw: str, current: SessionConfig) -> Parsed:
    """One client message -> its record; RealtimeError names the field that is wrong."""
    if len(raw) > MAX_APPEND_CHARS + 1024:
        raise RealtimeError(f"the event has {len(raw)} characters; the limit is "
                            f"{MAX_APPEND_CHARS} for an append", "audio", "event_too_large")
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise RealtimeError(f"the event is not JSON: {error}", None, "invalid_json") from None
    event_id = body.get("event_id") if isinstance(body, dict) else None
    event_id = event_id if isinstance(event_id, str) and len(event_id) <= MAX_ID_CHARS else None
    fields = _Fields(body, "", event_id)
    kind = fields.string("type", MAX_ID_CHARS)
    if kind != "input_audio_buffer.append" and len(raw) > MAX_EVENT_CHARS:
        raise fields.refuse("type", f"a {kind} event has {len(raw)} characters; the limit is "
                            f"{MAX_EVENT_CHARS}")
    parser = _PARSERS.get(kind or "")
    if parser is None:
        raise RealtimeError(f"unknown event type {kind!r}; served: {sorted(_PARSERS)}", "type",
                            "invalid_event_type", event_id)
    return Parsed(parser(fields, current), event_id)


def _session_update(fields: _Fields, current: SessionConfig) -> SessionUpdate:
    session = fields.obj("session")
    if session is None:
        raise fields.refuse("session", "session.update needs a `session` object")
    kind = session.string("type", MAX_ID_CHARS)
    if kind not in (None, "realtime"):
        raise session.refuse("session.type", f"session.type must be 'realtime', got {kind!r}")
    modalities = session.body.get("output_modalities")
    if modalities is not None and modalities != ["audio"]:
        raise session.refuse("session.output_modalities",
                             "session.output_modalities must be ['audio'] (answers are spoken)")
    instructions = session.string("instructions")
    tokens = _max_output_tokens(session)
    voice, vad = current.voice, current.turn_detection
    audio = session.obj("audio")
    if audio is not None:
        audio_in, audio_out = audio.obj("input"), audio.obj("output")
        if audio_in is not None:
            _check_format(audio_in)
            if audio_in.has("turn_detection"):
                vad = _turn_detection(audio_in)
        if audio_out is not None:
            _check_format(audio_out)
            voice = audio_out.string("voice", MAX_ID_CHARS) or voice
    return SessionUpdate(SessionConfig(
        instructions=current.instructions if instructions is None else instructions,
        voice=voice, turn_detection=vad,
        max_output_tokens=current.max_output_tokens if tokens is None else tokens))


def _max_output_tokens(fields: _Fields) -> int | None:
    """An integer, or "inf" (= the thinker's own default, given as 0 here)."""
    if fields.body.get("max_output_tokens") == "inf":
        return 0
    return fields.integer("max_output_tokens", 1, 1 << 20)


def _check_format(audio: _Fields) -> None:
    fmt = audio.obj("format")
    if fmt is None:
        return
    kind, rate = fmt.body.get("type"), fmt.body.get("rate", PCM_RATE)
    if kind != PCM_TYPE or rate != PCM_RATE:
        raise fmt.refuse(fmt.path, f"{fmt.path} must be {{type: '{PCM_TYPE}', rate: "
                         f"{PCM_RATE}}} (PCM16 mono), got type {kind!r} rate {rate!r}")


def _turn_detection(audio_in: _Fields) -> ServerVad | None:
    detection = audio_in.obj("turn_detection")
    if detection is None:
        return None  # null: the client commits and asks for responses itself
    kind = detection.string("type", MAX_ID_CHARS)
    if kind != "server_vad":
        raise detection.refuse(detection.name("type"), f"{detection.name('type')} must be "
                               f"'server_vad' (or turn_detection null), got {kind!r}")
    threshold = detection.body.get("threshold")
    if threshold is not None and (not isinstance(threshold, (int, float))
                                  or isinstance(threshold, bool) or not 0 < threshold < 1):
        raise detection.refuse(detection.name("threshold"),
                               f"{detection.name('threshold')} must be a number in (0, 1)")
    silence = detection.integer("silence_duration_ms", 1, MAX_SILENCE_MS)
    create, interrupt = detection.boolean("create_response"), detection.boolean(
        "interrupt_response")
    return ServerVad(silence_duration_ms=silence or DEFAULT_SILENCE_MS,
                     threshold=float(threshold or 0.0),
                     create_response=True if create is None else create,
                     interrupt_response=True if interrupt is None else interrupt)


def _append(fields: _Fields, current: SessionConfig) -> Append:
    audio = fields.string("audio", MAX_APPEND_CHARS)
    if audio is None:
        raise fields.refuse("audio", "input_audio_buffer.append needs `audio` (base64 PCM16)")
    try:
        data = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise fields.refuse("audio", "audio is not valid base64") from None
    if len(data) % PCM_BYTES_PER_SAMPLE:
        raise fields.refuse("audio", "audio must be whole 16-bit samples (an even byte count)")
    return Append(np.frombuffer(data, dtype="<i2").astype(np.int16))


def _item_create(fields: _Fields, current: SessionConfig) -> ItemCreate:
    item = fields.obj("item")
    if item is None:
        raise fields.refuse("item", "conversation.item.create needs an `item`")
    if item.string("type", MAX_ID_CHARS) != "message":
        raise item.refuse("item.type", "item.type must be 'message' (no tools are served)")
    role = item.string("role", MAX_ID_CHARS)
    if role not in ("user", "assistant", "system"):
        raise item.refuse("item.role", f"item.role must be user, assistant or system, got "
                          f"{role!r}")
    content = item.body.get("content")
    if not isinstance(content, list) or not content:
        raise item.refuse("item.content", "item.content must be a non-empty list")
    texts = []
    for index, raw in enumerate(content):
        part = _Fields(raw, f"item.content[{index}]", fields.event_id)
        kind = part.string("type", MAX_ID_CHARS)
        if kind not in ("input_text", "output_text", "text"):
            raise part.refuse(part.name("type"), f"{part.name('type')} {kind!r} is not "
                              "served: send text (speech goes through input_audio_buffer)")
        texts.append(part.string("text") or "")
    text = " ".join(t for t in texts if t)
    if len(text) > MAX_TEXT_CHARS:
        raise item.refuse("item.content", f"the item's text is longer than {MAX_TEXT_CHARS}")
    return ItemCreate(role, text, item.string("id", MAX_ID_CHARS),
                      fields.string("previous_item_id", MAX_ID_CHARS))


def _truncate(fields: _Fields, current: SessionConfig) -> Truncate:
    item_id = fields.string("item_id", MAX_ID_CHARS)
    end = fields.integer("audio_end_ms", 0, 1 << 31)
    if item_id is None or end is None:
        raise fields.refuse("item_id" if item_id is None else "audio_end_ms",
                            "conversation.item.truncate needs item_id and audio_end_ms")
    return Truncate(item_id, fields.integer("content_index", 0, 0) or 0, end)


def _response_create(fields: _Fields, current: SessionConfig) -> ResponseCreate:
    response = fields.obj("response")
    if response is None:
        return ResponseCreate(None, None)
    modalities = response.body.get("output_modalities")
    if modalities is not None and modalities != ["audio"]:
        raise response.refuse("response.output_modalities",
                              "response.output_modalities must be ['audio']")
    return ResponseCreate(response.string("instructions"), _max_output_tokens(response))


_PARSERS: dict[str, Callable[[_Fields, SessionConfig], ClientEvent]] = {
    "session.update": _session_update,
    "input_audio_buffer.append": _append,
    "input_audio_buffer.commit": lambda fields, current: Commit(),
    "input_audio_buffer.clear": lambda fields, current: Clear(),
    "conversation.item.create": _item_create,
    "conversation.item.truncate": _truncate,
    "response.create": _response_create,
    "response.cancel": lambda fields, current: ResponseCancel(
        fields.string("response_id", MAX_ID_CHARS)),
}


# -- server items ---------------------------------------------------------------------------


def user_audio_item(item_id: str, transcript: str | None, status: str) -> JsonObject:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user",
            "status": status, "content": [{"type": "input_audio", "transcript": transcript}]}


def text_item(item_id: str, role: str, text: str) -> JsonObject:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": role,
            "status": "completed", "content": [{"type": kind, "text": text}]}


def assistant_audio_item(item_id: str, transcript: str | None, status: str) -> JsonObject:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant",
            "status": status, "content": [] if transcript is None else [
                {"type": "output_audio", "transcript": transcript}]}


def pcm_base64(pcm: npt.NDArray[np.floating]) -> str:
    """float samples in [-1, 1] -> base64 PCM16 little-endian."""
    return base64.b64encode(to_int16(pcm).tobytes()).decode()
