"""POST /v1/audio/transcriptions: OpenAI's form in; json, text, verbose_json, srt or vtt out,
or (stream=true, json/text) OpenAI's `transcript.text.delta` / `transcript.text.done` events."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.mesh.events import Done, Output
from stagemesh.gateway.transcriptions.pipeline import (
    TranscriptEvents,
    prepare_transcription,
    transcribe,
    transcript_events,
)
from stagemesh.gateway.transcriptions.protocol import (
    ResponseFormat,
    Transcript,
    srt,
    transcription_request,
    usage,
    verbose_json,
    vtt,
)
from stagemesh.gateway.wire.forms import read_form
from stagemesh.gateway.wire.requests import rest_context, until_disconnect
from stagemesh.gateway.wire.streams import Payload, sse_response


def transcript_response(transcript: Transcript, fmt: ResponseFormat) -> Response:
    """A whole transcript in the asked format (OpenAI's bodies and media types)."""
    match fmt:
        case ResponseFormat.TEXT:
            return PlainTextResponse(transcript.text)
        case ResponseFormat.SRT:
            return PlainTextResponse(srt(transcript.segments))
        case ResponseFormat.VTT:
            return PlainTextResponse(vtt(transcript.segments), media_type="text/vtt")
        case ResponseFormat.VERBOSE_JSON:
            return JSONResponse(verbose_json(transcript))
    return JSONResponse({"text": transcript.text, "usage": usage(transcript.seconds)})


async def _deltas(items: TranscriptEvents) -> AsyncGenerator[Payload, None]:
    """Each final segment as a `transcript.text.delta` (joined by spaces), then `done`."""
    sent = False
    try:
        async for item in items:
            if isinstance(item, Output) and item.value.text:
                yield {"type": "transcript.text.delta",
                       "delta": (" " if sent else "") + item.value.text}
                sent = True
            elif isinstance(item, Done):
                yield {"type": "transcript.text.done", "text": item.result.text}
    finally:
        await items.aclose()


class TranscriptionRoutes:
    """The listening routes, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def transcriptions(self, request: Request) -> Response:
        form = await read_form(request)
        transcription = transcription_request(form)
        job = await prepare_transcription(self.core, transcription)  # 400 before any stage
        context = rest_context(request, form.text("timeout"))
        if transcription.stream:
            return sse_response(_deltas(transcript_events(self.core, job, context)))
        transcript = await until_disconnect(request, transcribe(self.core, job, context))
        return transcript_response(transcript, transcription.response_format)
