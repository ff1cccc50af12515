"""OpenAI-compatible REST routes: images, chat completions (image output), speech, models,
health.

These are written explicitly because their JSON shapes are OpenAI's, not the proto's. Every
handler runs its work next to a disconnect listener: a client that goes away cancels the request
(its CancelScope), including for non-streaming responses.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stagemesh.gateway.errors import GatewayError, InvalidRequest, http_status
from stagemesh.gateway.events import Done, Output, StageEvent, stream_pipeline
from stagemesh.gateway.images import (
    GeneratedImage,
    generate_images,
    parse_size,
    validate_image_params,
)
from stagemesh.gateway.mesh import Mesh
from stagemesh.gateway.metrics import TTFP_SECONDS
from stagemesh.gateway.recipes import Recipe, Task
from stagemesh.gateway.speech import (
    MEDIA_TYPES,
    AudioPiece,
    SpeechParams,
    SpeechSummary,
    StreamEncoder,
    recipe_voices,
    ref_audio_bytes,
    synthesize,
    synthesize_all,
    validate_speech_params,
)
from stagemesh.shared.proto.v1 import common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BODY_BYTES = 32 * 1024 * 1024
TIMEOUT_HEADER = "x-request-timeout"

EXECUTION_MODES = {"step": common_pb2.EXECUTION_MODE_STEP,
                   "request": common_pb2.EXECUTION_MODE_REQUEST}


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.to_openai(), status_code=http_status(error.code))


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidRequest("body", f"request body larger than {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError as error:
        raise InvalidRequest("body", f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "request body must be a JSON object")
    # Clients that send `extra_body` literally (curl users copying SDK code) get it merged.
    extra = body.pop("extra_body", None)
    if isinstance(extra, dict):
        body = {**body, **extra}
    return body


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (and raise ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.create_task(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone()
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()


def _typed(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (isinstance(value, bool)
                              and kind is not bool)):
        raise InvalidRequest(name, f"{name} must be of type {getattr(kind, '__name__', kind)}")
    return value


def _timeout(request: Request, body: dict[str, Any]) -> float | None:
    value = body.get("timeout", request.headers.get(TIMEOUT_HEADER))
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidRequest("timeout",
                             f"timeout must be a number of seconds, got {value!r}") from None


def image_params_from(mesh: Mesh, body: dict[str, Any]) -> tuple[Any, Any]:
    """OpenAI image fields + stagemesh extensions -> (recipe, ImageParams)."""
    recipe = mesh.recipe(_typed(body, "model", str), Task.TEXT_TO_IMAGE)
    width, height = (parse_size(body["size"]) if isinstance(body.get("size"), str)
                     else (_typed(body, "width", int), _typed(body, "height", int)))
    if body.get("response_format", "b64_json") != "b64_json":
        raise InvalidRequest("response_format", "only response_format 'b64_json' is supported")
    scale = body.get("true_cfg_scale", body.get("guidance_scale"))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise InvalidRequest("true_cfg_scale", "true_cfg_scale must be a number")
    mode = body.get("execution_mode")
    if mode is not None and mode not in EXECUTION_MODES:
        raise InvalidRequest("execution_mode", f"execution_mode must be one of "
                             f"{sorted(EXECUTION_MODES)}")
    params = validate_image_params(
        recipe, prompt=_typed(body, "prompt", str),
        negative_prompt=_typed(body, "negative_prompt", str), n=_typed(body, "n", int),
        width=width, height=height,
        num_inference_steps=_typed(body, "num_inference_steps", int),
        true_cfg_scale=scale, seed=_typed(body, "seed", int),
        execution_mode=EXECUTION_MODES.get(mode, common_pb2.EXECUTION_MODE_UNSPECIFIED))
    return recipe, params


def _b64(image: GeneratedImage) -> str:
    return base64.b64encode(image.png).decode()


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _progress_payload(item: StageEvent) -> dict[str, Any] | None:
    kind = item.response.WhichOneof("event")
    if kind == "queued":
        return {"type": "queued", "stage": item.stage, "position": item.response.queued.position}
    if kind == "progress":
        p = item.response.progress
        return {"type": "progress", "stage": item.stage, "step": p.step_index,
                "total_steps": p.total_steps, "step_seconds": p.step_seconds,
                "elapsed_seconds": p.elapsed_seconds}
    return None


class OpenAIRoutes:
    """Handlers bound to one Mesh."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def routes(self) -> list[Route]:
        return [
            Route("/v1/images/generations", self.images_generations, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/audio/speech", self.audio_speech, methods=["POST"]),
            Route("/v1/audio/voices", self.audio_voices, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]

    async def _generate(self, request: Request, body: dict[str, Any]) -> list[GeneratedImage]:
        recipe, params = image_params_from(self.mesh, body)
        async with self.mesh.request_scope(recipe, request.state.request_id,
                                           _timeout(request, body)) as scope:
            return await until_disconnect(request, generate_images(
                recipe, params, scope, self.mesh.stubs(recipe)))

    async def images_generations(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            if body.get("stream"):
                return await self._images_stream(request, body)
            images = await self._generate(request, body)
        except GatewayError as error:
            return error_response(error)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse({"created": int(time.time()),
                             "data": [{"b64_json": _b64(i), "revised_prompt": None,
                                       "seed": i.seed} for i in images]})

    async def _images_stream(self, request: Request, body: dict[str, Any]) -> Response:
        recipe, params = image_params_from(self.mesh, body)  # 400 before the stream starts
        timeout = _timeout(request, body)

        async def events() -> AsyncIterator[bytes]:
            try:
                async with self.mesh.request_scope(recipe, request.state.request_id,
                                                   timeout) as scope:
                    yield _sse({"type": "request", "request_id": scope.request_id})
                    async for item in stream_pipeline(lambda emit: generate_images(
                            recipe, params, scope, self.mesh.stubs(recipe), emit)):
                        if isinstance(item, StageEvent):
                            payload = _progress_payload(item)
                            if payload:
                                yield _sse(payload)
                        elif isinstance(item, Output):
                            yield _sse({"type": "image", "b64_json": _b64(item.value),
                                        "seed": item.value.seed})
                        elif isinstance(item, Done):
                            yield _sse({"type": "done"})
            except GatewayError as error:
                yield _sse({"type": "error", **error.to_openai()})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            body["prompt"] = _last_user_text(body.get("messages"))
            if "height" in body or "width" in body:
                body.pop("size", None)
            images = await self._generate(request, body)
        except GatewayError as error:
            return error_response(error)
        except ClientGone:
            return Response(status_code=499)
        content = [{"type": "image_url",
                    "image_url": {"url": f"data:image/png;base64,{_b64(i)}"}} for i in images]
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or "",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        })

    async def audio_speech(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            recipe, params, stream = await speech_params_from(self.mesh, body)
            if stream:
                return await self._speech_stream(request, body, recipe, params)
            async with self.mesh.request_scope(recipe, request.state.request_id,
                                               _timeout(request, body)) as scope:
                audio, _ = await until_disconnect(request, synthesize_all(
                    recipe, params, scope, self.mesh.stubs(recipe)))
        except GatewayError as error:
            return error_response(error)
        except ClientGone:
            return Response(status_code=499)
        return Response(audio, media_type=MEDIA_TYPES[params.response_format])

    async def _speech_stream(self, request: Request, body: dict[str, Any], recipe: Recipe,
                             params: SpeechParams) -> Response:
        """Audio bytes as the codec produces them.

        The response is committed only when the first audio chunk is ready, so an error before
        any audio (a bad field the talker found, a stage down) is still a JSON error with its
        status; after that, an error cuts the connection instead (see `_speech_body`).
        """
        timeout = _timeout(request, body)
        started = time.monotonic()

        async def run(emit: Any) -> Any:
            async with self.mesh.request_scope(recipe, request.state.request_id,
                                               timeout) as scope:
                return await synthesize(recipe, params, scope, self.mesh.stubs(recipe), emit)

        items = stream_pipeline(run)
        try:
            first = await until_disconnect(request, _next_audio(items))
        except BaseException:
            await items.aclose()
            raise
        TTFP_SECONDS.labels(recipe=recipe.name).observe(time.monotonic() - started)
        return StreamingResponse(_speech_body(first, items, params),
                                 media_type=MEDIA_TYPES[params.response_format],
                                 headers={"cache-control": "no-cache"})

    async def audio_voices(self, request: Request) -> Response:
        try:
            recipe = self.mesh.recipe(request.query_params.get("model"), Task.TEXT_TO_SPEECH)
        except GatewayError as error:
            return error_response(error)
        voices = await asyncio.to_thread(recipe_voices, recipe)
        if voices is None:
            return error_response(GatewayError(
                grpc.StatusCode.UNAVAILABLE, f"the voices of {recipe.name} are not readable "
                "from this gateway (its model folder is not mounted here)"))
        return JSONResponse({"model": recipe.name, "voices": voices})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "stagemesh",
             "task": recipe.task.value} for name, recipe in self.mesh.recipes.items()]})

    async def health(self, request: Request) -> Response:
        stages = await self.mesh.stage_infos()
        healthy = all(s.health == "SERVING" for s in stages)
        return JSONResponse({"status": "ok" if healthy else "degraded",
                             "stages": {f"{s.recipe}/{s.name}": s.health for s in stages}},
                            status_code=200 if healthy else 503)


#: Speech fields that are plain strings in the request body.
_SPEECH_STRINGS = ("voice", "response_format", "task_type", "language", "instructions",
                   "ref_text")


async def speech_params_from(mesh: Mesh, body: dict[str, Any]) -> tuple[Recipe, SpeechParams,
                                                                        bool]:
    """OpenAI speech fields + the seed's extensions -> (recipe, SpeechParams, stream)."""
    recipe = mesh.recipe(_typed(body, "model", str), Task.TEXT_TO_SPEECH)
    stream = bool(_typed(body, "stream", bool))
    stream_format = _typed(body, "stream_format", str)
    if stream_format not in (None, "audio"):
        raise InvalidRequest("stream_format", "only stream_format 'audio' is supported")
    ref_audio = _typed(body, "ref_audio", str)
    speed = _typed(body, "speed", (int, float))
    # Decoding a reference clip is CPU work: keep it off the event loop.
    params = await asyncio.to_thread(
        validate_speech_params,
        recipe, input=_typed(body, "input", str),
        voices=await asyncio.to_thread(recipe_voices, recipe),
        **{name: _typed(body, name, str) for name in _SPEECH_STRINGS},
        speed=None if speed is None else float(speed),
        ref_audio=None if ref_audio is None else ref_audio_bytes(ref_audio),
        seed=_typed(body, "seed", int), max_new_tokens=_typed(body, "max_new_tokens", int),
        temperature=_typed(body, "temperature", (int, float)),
        top_p=_typed(body, "top_p", (int, float)), top_k=_typed(body, "top_k", int))
    return recipe, params, stream


async def _next_audio(items: AsyncIterator[Any]) -> AudioPiece | SpeechSummary:
    """The pipeline's first audio chunk, or its summary if it finished without audio."""
    async for item in items:
        if isinstance(item, Output):
            return item.value  # type: ignore[no-any-return]
        if isinstance(item, Done):
            return item.result  # type: ignore[no-any-return]
    raise RuntimeError("the speech pipeline ended without a result")


class AudioStreamBroken(Exception):
    """A streamed speech response failed after its first bytes: the connection is cut."""


async def _speech_body(first: AudioPiece | SpeechSummary, items: AsyncIterator[Any],
                       params: SpeechParams) -> AsyncIterator[bytes]:
    """Encoded audio: the first chunk (with the WAV header), then each chunk as it comes.

    Binary audio is never followed by a JSON error: a failure mid-stream is logged and ends the
    response without its terminating chunk, which every HTTP client reports as an error.
    """
    if isinstance(first, SpeechSummary):  # no audio at all (an immediate end-of-audio frame)
        yield StreamEncoder(params.response_format, first.sample_rate).end()
        return
    encoder = StreamEncoder(params.response_format, first.sample_rate)
    try:
        yield encoder.chunk(first.pcm)
        async for item in items:
            if isinstance(item, Output):
                piece = encoder.chunk(item.value.pcm)
                if piece:
                    yield piece
        tail = encoder.end()
        if tail:
            yield tail
    except GatewayError as error:
        log.error("speech stream failed after audio was sent: %s", error.message)
        raise AudioStreamBroken(error.message) from None
    finally:
        await items.aclose()


def _last_user_text(messages: Any) -> str:
    """The prompt of a chat request: the text of the last user message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "messages must be a non-empty list")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                texts = [p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type") == "text"]
                return " ".join(t for t in texts if t)
    raise InvalidRequest("messages", "messages must contain a user message with text")

