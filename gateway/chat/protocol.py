"""A chat request: OpenAI's chat completions body -> the records the pipeline runs on.

The JSON shape is checked here (roles, content parts, modalities, sampling fields); the limits
are checked against what the thinker publishes when the request is prepared (pipeline.py). A
chat with an image recipe reads the last user message as an image prompt (and, for an edit,
its `image_url` parts as the images to edit). Every refusal names its field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.edit_protocol import EditRequest
from stagemesh.gateway.images.protocol import ImageRequest, image_request
from stagemesh.gateway.speech.audio import AudioFormat
from stagemesh.gateway.wire.requests import MAX_BODY_BYTES, JsonFields, image_data_url

#: POST /v1/chat/completions may carry images to edit (data URLs).
CHAT_BODY_BYTES = MAX_BODY_BYTES
#: Roles a conversation may hold; OpenAI's "developer" is the system prompt of newer models.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: OpenAI's audio output formats that stagemesh encodes -> its own format names.
AUDIO_FORMATS = {"wav": AudioFormat.WAV, "pcm16": AudioFormat.PCM, "pcm": AudioFormat.PCM,
                 "flac": AudioFormat.FLAC}
#: The formats of a user message's `input_audio` parts (OpenAI's; libsndfile decodes both).
INPUT_AUDIO_FORMATS = ("wav", "mp3")
#: OpenAI fields stagemesh cannot honour: refused rather than silently ignored.
UNSUPPORTED_FIELDS = ("stop", "tools", "functions", "logprobs", "response_format")


@dataclass(frozen=True)
class ChatOptions:
    """What the OpenAI body asks of the response itself (not of the thinker)."""

    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class AudioPart:
    """A user message's `input_audio` part, still base64 (decoded when the request is
    prepared, off the event loop); `field` names it in errors."""

    data: str
    field: str  # messages[i].content[j].input_audio


@dataclass(frozen=True)
class ChatTurn:
    role: str  # "system", "user" or "assistant"
    content: str
    #: Spoken parts, heard by the chat recipe's listener and appended to `content` in order.
    audio: tuple[AudioPart, ...] = ()


@dataclass(frozen=True)
class AudioOutput:
    """Speak the answer: a voice of the speech recipe (None = its default) and a format."""

    voice: str | None = None
    format: str | None = None  # one of AUDIO_FORMATS; None = wav


@dataclass(frozen=True)
class ChatRequest:
    """A chat request as the client sent it; None = not given."""

    messages: tuple[ChatTurn, ...]
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    audio: AudioOutput | None = None
    priority: int = 0


# -- the body -------------------------------------------------------------------------------


def _audio_part(part: Mapping[str, object], index: int, position: int) -> AudioPart:
    """OpenAI's `{"type": "input_audio", "input_audio": {"data": base64, "format": ...}}`."""
    where = f"messages[{index}].content[{position}].input_audio"
    raw = part.get("input_audio")
    if not isinstance(raw, dict):
        raise InvalidRequest(where, f'{where} must be {{"data": <base64>, "format": "wav"}}')
    fmt = raw.get("format")
    if fmt not in INPUT_AUDIO_FORMATS:
        raise InvalidRequest(f"{where}.format", f"{where}.format must be one of "
                             f"{list(INPUT_AUDIO_FORMATS)}, got {fmt!r}")
    data = raw.get("data")
    if not isinstance(data, str) or not data:
        raise InvalidRequest(f"{where}.data", f"{where}.data must be base64 audio")
    return AudioPart(data, where)


def _content(value: object, index: int, role: str) -> tuple[str, tuple[AudioPart, ...]]:
    """A message's text (a string, or the text parts of a content list) and its spoken parts
    (a user message's `input_audio` parts)."""
    if isinstance(value, str):
        return value, ()
    if isinstance(value, list):
        texts, audio = [], []
        for position, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(part, dict) and kind == "input_audio" and role == "user":
                audio.append(_audio_part(part, index, position))
            elif isinstance(part, dict) and kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise InvalidRequest(f"messages.[{index}].content", "only text content parts "
                                     "(and input_audio parts in user messages) are supported")
        return "".join(texts), tuple(audio)
    raise InvalidRequest(f"messages.[{index}].content", "content must be a string or a list")


def _turns(messages: object) -> tuple[ChatTurn, ...]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "messages must be a non-empty list")
    turns = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(f"messages.[{index}].role",
                                 f"role must be one of {sorted(ROLES)}, got {role!r}")
        text, audio = _content(message.get("content"), index, ROLES[role])
        turns.append(ChatTurn(ROLES[role], text, audio))
    return tuple(turns)


def _audio(body: Mapping[str, object]) -> AudioOutput | None:
    """`modalities` + `audio`: speak the answer, or not."""
    modalities = body.get("modalities") or ["text"]
    if not isinstance(modalities, list) or not set(modalities) <= {"text", "audio"} \
            or "text" not in modalities:
        raise InvalidRequest("modalities", 'modalities must be ["text"] or ["text", "audio"]')
    raw = body.get("audio")
    if "audio" not in modalities:
        if raw is not None:
            raise InvalidRequest("audio", 'audio needs modalities ["text", "audio"]')
        return None
    if not isinstance(raw, dict):
        raise InvalidRequest("audio", 'modalities ["text", "audio"] needs audio: '
                             '{"voice": ..., "format": ...}')
    fields = JsonFields(raw)
    return AudioOutput(voice=fields.string("voice"), format=fields.string("format"))


def chat_request(body: Mapping[str, object]) -> tuple[ChatRequest, ChatOptions]:
    """The OpenAI body of a chat answer -> (the request, the response's options)."""
    fields = JsonFields(body)
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequest(name, f"{name} is not supported by this server")
    if fields.integer("n") not in (None, 1):
        raise InvalidRequest("n", "only n=1 is supported")
    max_completion = fields.integer("max_completion_tokens")
    stream_options = body.get("stream_options")
    include_usage = isinstance(stream_options, dict) and stream_options.get("include_usage")
    request = ChatRequest(
        messages=_turns(body.get("messages")), model=fields.string("model") or "",
        max_tokens=max_completion if max_completion is not None else fields.integer("max_tokens"),
        temperature=fields.number("temperature"), top_p=fields.number("top_p"),
        seed=fields.integer("seed"), audio=_audio(body), priority=fields.integer("priority") or 0)
    return request, ChatOptions(stream=bool(fields.boolean("stream")),
                                include_usage=include_usage is True)


def chat_image_request(body: Mapping[str, object]) -> ImageRequest:
    """POST /v1/chat/completions with image output: the prompt is the last user message's
    text; width/height (in extra_body) win over size."""
    fields = {key: value for key, value in body.items() if key != "prompt"}
    if "height" in body or "width" in body:
        fields.pop("size", None)
    prompt = last_user_text(body.get("messages"))
    if not prompt.strip():  # the client sent messages, not a prompt: name those
        raise InvalidRequest("messages", "the last user message must have text")
    fields["prompt"] = prompt
    return image_request(fields)


def last_user_text(messages: object) -> str:
    """The prompt of a chat request: the text of the last user message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "messages must be a non-empty list")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                texts = [str(p.get("text", "")) for p in content
                         if isinstance(p, dict) and p.get("type") == "text"]
                return " ".join(t for t in texts if t)
    raise InvalidRequest("messages", "messages must contain a user message with text")


def chat_edit_request(body: Mapping[str, object]) -> EditRequest:
    """An edit over chat: the last user message's text is the instruction, its `image_url`
    parts (data URLs) the images to edit; the image fields as for text-to-image (extra_body).
    Decodes base64: call it off the event loop."""
    return EditRequest(image=chat_image_request(body),
                       images=_last_user_images(body.get("messages")))


def _last_user_images(messages: object) -> tuple[bytes, ...]:
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"] \
        if isinstance(messages, list) else []
    content = users[-1].get("content") if users else None
    parts = [part for part in content if isinstance(part, dict)
             and part.get("type") == "image_url"] if isinstance(content, list) else []
    images = []
    for part in parts:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidRequest("messages", 'an image_url part must look like {"type": '
                                 '"image_url", "image_url": {"url": "data:image/png;base64,..."}}')
        images.append(image_data_url(url.strip(), "messages"))
    if not images:
        raise InvalidRequest("messages", "an image-edit model needs the image to edit: an "
                             "image_url content part (a data URL) in the last user message")
    return tuple(images)
