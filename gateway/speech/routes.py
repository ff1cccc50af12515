"""POST /v1/audio/speech (one-shot or streamed audio) and GET /v1/audio/voices."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.mesh.events import Done, Output
from stagemesh.gateway.speech.audio import MEDIA_TYPES, AudioFormat, StreamEncoder
from stagemesh.gateway.speech.pipeline import (
    AudioPiece,
    SpeechEvents,
    SpeechJob,
    SpeechSummary,
    prepare_speech,
    speech_events,
    synthesize_all,
    voices,
)
from stagemesh.gateway.speech.protocol import SPEECH_BODY_BYTES, speech_request
from stagemesh.gateway.wire.requests import (
    off_loop,
    openai_body,
    read_json_object,
    rest_context,
    until_disconnect,
)
from stagemesh.gateway.wire.streams import TTFP_SECONDS

log = logging.getLogger(__name__)

class AudioStreamBroken(Exception):
    """A streamed speech response failed after its first bytes: the connection is cut."""


class AudioRoutes:
    """The speech routes, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def speech(self, request: Request) -> Response:
        body = openai_body(await read_json_object(request, SPEECH_BODY_BYTES))
        clip = body.get("ref_audio")  # base64 of up to megabytes: decoded off the loop
        speech, stream = await off_loop(len(clip) if isinstance(clip, str) else 0,
                                        lambda: speech_request(body))
        job = await prepare_speech(self.core, speech)  # 400 before any audio
        context = rest_context(request, body.get("timeout"))
        if stream:
            return await self._stream(request, job, context)
        audio = await until_disconnect(request, synthesize_all(self.core, job, context))
        return Response(audio, media_type=MEDIA_TYPES[job.params.response_format])

    async def _stream(self, request: Request, job: SpeechJob,
                      context: RequestContext) -> Response:
        """Audio bytes as the codec produces them.

        The response is committed only when the first audio chunk is ready, so an error before
        any audio (a bad field the talker found, a stage down) is still a JSON error with its
        status; after that, an error cuts the connection instead (see `_speech_body`).
        """
        started = time.monotonic()
        items = speech_events(self.core, job, context)
        try:
            first = await until_disconnect(request, _next_audio(items))
        except BaseException:
            await items.aclose()
            raise
        TTFP_SECONDS.labels(recipe=job.recipe.name).observe(time.monotonic() - started)
        return StreamingResponse(_speech_body(first, items, job.params.response_format),
                                 media_type=MEDIA_TYPES[job.params.response_format],
                                 headers={"cache-control": "no-cache"})

    async def voices(self, request: Request) -> Response:
        """The voices of a speech model, as its talker publishes them."""
        recipe, names = await voices(self.core, request.query_params.get("model"))
        return JSONResponse({"model": recipe.name, "voices": names})


async def _next_audio(items: SpeechEvents) -> AudioPiece | SpeechSummary:
    """The pipeline's first audio chunk, or its summary if it finished without audio."""
    async for item in items:
        if isinstance(item, Output):
            return item.value
        if isinstance(item, Done):
            return item.result
    raise RuntimeError("the speech pipeline ended without a result")


async def _speech_body(first: AudioPiece | SpeechSummary, items: SpeechEvents,
                       fmt: AudioFormat) -> AsyncIterator[bytes]:
    """Encoded audio: the first chunk (with the WAV header), then each chunk as it comes.

    Binary audio is never followed by a JSON error: a failure mid-stream is logged and ends the
    response without its terminating chunk, which every HTTP client reports as an error.
    """
    try:
        if isinstance(first, SpeechSummary):  # no audio at all (an immediate end-of-audio)
            yield StreamEncoder(fmt, first.sample_rate).end()
            return
        encoder = StreamEncoder(fmt, first.sample_rate)
        yield encoder.chunk(first.pcm)
        async for item in items:
            if isinstance(item, Output) and (piece := encoder.chunk(item.value.pcm)):
                yield piece
        if tail := encoder.end():
            yield tail
    except GatewayError as error:
        log.error("speech stream failed after audio was sent: %s", error.message)
        raise AudioStreamBroken(error.message) from None
    finally:
        await items.aclose()
