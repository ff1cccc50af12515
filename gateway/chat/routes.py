"""POST /v1/chat/completions: the recipe named by `model` decides what chat does.

- A chat recipe (task `chat`): the thinker answers in text, OpenAI's chat shape, `stream: true`
  as `chat.completion.chunk` server-sent events, with usage. With `modalities: ["text",
  "audio"]` and `audio: {voice, format}` the answer is also spoken (OpenAI's audio-output
  shape: `message.audio` = {id, data (base64), expires_at, transcript}, and `content` null as
  OpenAI answers it); streamed, the transcript arrives in `delta.audio.transcript` pieces as
  the thinker writes it and the audio in `delta.audio.data` pieces sentence by sentence.
- An image recipe (or no `model` while one is served): the image comes back as a data URL in
  `choices[0].message.content[0].image_url.url`, as vllm-omni serves it.
- An image-edit recipe: the last user message carries the instruction (text parts) and the
  image to edit (an `image_url` part with a data URL: the server fetches no URLs); the edited
  image comes back in the same shape.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stagemesh.gateway.chat.pipeline import (
    ChatEvents,
    ChatJob,
    ChatSummary,
    SpokenPiece,
    TextPiece,
    chat_events,
    chat_recipe,
    prepare_chat,
)
from stagemesh.gateway.chat.protocol import (
    CHAT_BODY_BYTES,
    ChatOptions,
    chat_edit_request,
    chat_image_request,
    chat_request,
)
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.images.pipeline import (
    generate_images,
    prepare_edit,
    prepare_images,
    run_edit,
)
from stagemesh.gateway.images.routes import b64_png
from stagemesh.gateway.mesh.events import Done, Output
from stagemesh.gateway.recipes import Task
from stagemesh.gateway.speech.audio import AudioFormat, StreamEncoder, encode_audio
from stagemesh.gateway.wire.requests import (
    JsonFields,
    JsonObject,
    openai_body,
    read_json_object,
    rest_context,
    until_disconnect,
)
from stagemesh.gateway.wire.streams import Payload, sse_response

#: How long OpenAI says a returned audio may be referred to again (we keep none: informative).
AUDIO_EXPIRES_S = 3600
@dataclass
class _Completion:
    """One answer's ids and creation time, shared by every chunk of a stream."""

    model: str
    audio_format: AudioFormat | None
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    audio_id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, kind: str) -> JsonObject:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, delta: JsonObject, finish_reason: str | None = None) -> JsonObject:
        return {**self.envelope("chat.completion.chunk"), "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    def expires_at(self) -> int:
        return int(time.time()) + AUDIO_EXPIRES_S


def _usage(summary: ChatSummary) -> JsonObject:
    return {"prompt_tokens": summary.prompt_tokens,
            "completion_tokens": summary.completion_tokens,
            "total_tokens": summary.prompt_tokens + summary.completion_tokens}


# -- the routes -----------------------------------------------------------------------------


class ChatRoutes:
    """The chat route, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def completions(self, request: Request) -> Response:
        body = openai_body(await read_json_object(request, CHAT_BODY_BYTES))
        recipe = chat_recipe(self.core, JsonFields(body).string("model") or "")
        if recipe is None:
            return await self._image(request, body)
        chat, options = chat_request(body)
        job = await prepare_chat(self.core, recipe, chat)  # 400 before any stage runs
        context = rest_context(request, body.get("timeout"))
        completion = _Completion(recipe.name, _format(job))
        if options.stream:
            return await self._stream(request, job, context, completion, options)
        return await until_disconnect(request, self._answer(job, context, completion))

    async def _answer(self, job: ChatJob, context: RequestContext,
                      completion: _Completion) -> Response:
        """The whole answer as one chat.completion."""
        spoken: list[SpokenPiece] = []
        summary: ChatSummary | None = None
        async with contextlib.aclosing(chat_events(self.core, job, context)) as items:
            async for item in items:
                if isinstance(item, Output) and isinstance(item.value, SpokenPiece):
                    spoken.append(item.value)
                elif isinstance(item, Done):
                    summary = item.result
        assert summary is not None  # chat_events always ends with Done (or raises)
        message: JsonObject = {"role": "assistant", "content": summary.text, "refusal": None}
        if completion.audio_format is not None:
            audio = await asyncio.to_thread(_encode_spoken, spoken, summary,
                                            completion.audio_format)
            message |= {"content": None, "audio": {
                "id": completion.audio_id, "data": base64.b64encode(audio).decode(),
                "expires_at": completion.expires_at(), "transcript": summary.text}}
        return JSONResponse({**completion.envelope("chat.completion"), "choices": [
            {"index": 0, "finish_reason": summary.finish_reason, "message": message,
             "logprobs": None}], "usage": _usage(summary)})

    async def _stream(self, request: Request, job: ChatJob, context: RequestContext,
                      completion: _Completion, options: ChatOptions) -> Response:
        """SSE chunks; committed once the first piece is ready, so an error before it (a
        prompt too long for the thinker, a stage down) still answers with its status."""
        items = chat_events(self.core, job, context)
        try:
            first = await until_disconnect(request, anext(items))
        except BaseException:
            await items.aclose()
            raise
        return sse_response(_chunks(first, items, completion, options))

    async def _image(self, request: Request, body: JsonObject) -> Response:
        """Chat with an image recipe (text-to-image, or image-edit when `model` names one):
        the image as a data URL."""
        named = self.core.recipes.get(JsonFields(body).string("model") or "")
        if named is not None and named.task is Task.IMAGE_EDIT:
            edit = await prepare_edit(self.core, await asyncio.to_thread(chat_edit_request, body))
            context = rest_context(request, body.get("timeout"))
            work = run_edit(self.core, edit, context)
        else:
            job = await prepare_images(self.core, chat_image_request(body))
            context = rest_context(request, body.get("timeout"))
            work = generate_images(self.core, job, context)
        images = await until_disconnect(request, work)
        content = [{"type": "image_url",
                    "image_url": {"url": f"data:image/png;base64,{b64_png(i)}"}} for i in images]
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or "",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        })


def _format(job: ChatJob) -> AudioFormat | None:
    return job.speech.params.response_format if job.speech is not None else None


def _encode_spoken(pieces: list[SpokenPiece], summary: ChatSummary, fmt: AudioFormat) -> bytes:
    pcm = np.concatenate([p.pcm for p in pieces]) if pieces else np.zeros(0, np.float32)
    return encode_audio(pcm, summary.sample_rate or (pieces[0].sample_rate if pieces else 1), fmt)


class _ChunkWriter:
    """Pipeline items -> chat.completion.chunk payloads (OpenAI's streaming shape)."""

    def __init__(self, completion: _Completion, options: ChatOptions) -> None:
        self.completion = completion
        self.options = options
        self.encoder: StreamEncoder | None = None

    def first(self) -> JsonObject:
        spoken = self.completion.audio_format is not None
        return self.completion.chunk({"role": "assistant", "content": None if spoken else ""})

    def of(self, item: object) -> list[JsonObject]:
        completion = self.completion
        if isinstance(item, Output) and isinstance(item.value, TextPiece):
            text = item.value.text
            if completion.audio_format is None:
                return [completion.chunk({"content": text})]
            return [completion.chunk({"audio": {"id": completion.audio_id, "transcript": text}})]
        if isinstance(item, Output) and isinstance(item.value, SpokenPiece):
            piece = item.value
            if self.encoder is None:
                assert completion.audio_format is not None
                self.encoder = StreamEncoder(completion.audio_format, piece.sample_rate)
            return [self._audio(self.encoder.chunk(piece.pcm))]
        if isinstance(item, Done):
            return self._end(item.result)
        return []

    def _audio(self, data: bytes, **extra: object) -> JsonObject:
        return self.completion.chunk({"audio": {
            "id": self.completion.audio_id, "data": base64.b64encode(data).decode(), **extra}})

    def _end(self, summary: ChatSummary) -> list[JsonObject]:
        chunks = []
        if self.completion.audio_format is not None:
            tail = self.encoder.end() if self.encoder is not None else b""
            chunks.append(self._audio(tail, expires_at=self.completion.expires_at()))
        chunks.append(self.completion.chunk({}, summary.finish_reason))
        if self.options.include_usage:
            chunks.append({**self.completion.envelope("chat.completion.chunk"), "choices": [],
                           "usage": _usage(summary)})
        return chunks


async def _chunks(first: object, items: ChatEvents, completion: _Completion,
                  options: ChatOptions) -> AsyncGenerator[Payload, None]:
    """The SSE chunks (sse_response ends them: an error event after a failure, [DONE])."""
    writer = _ChunkWriter(completion, options)
    try:
        yield writer.first()
        for payload in writer.of(first):
            yield payload
        async for item in items:
            for payload in writer.of(item):
                yield payload
    finally:
        await items.aclose()
