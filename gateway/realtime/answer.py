"""One realtime response: the conversation -> Thinker -> (piece by piece) Talker -> Codec,
the audio resampled to 24 kHz PCM16 and sent as `response.output_audio.delta` events.

Barge-in (`stop`): the answer is marked stopped at once, before anything else is sent, and no
audio delta leaves after that (every send re-checks the mark under the socket's lock). Then the
response's CancelScope cancels every stage call open for it (thinker, talker, codec: each ends
aborted at its next step) and no later one starts; `response.done` says `cancelled` with the
reason. Each transcript delta is a piece of the answer (the first clause, then sentences) sent
as the piece goes to the talker, so it runs ahead of its audio; the assistant item keeps the
text of the pieces whose audio was sent, each with the span of audio it had, so that
`conversation.item.truncate` can cut it where playback stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from stagemesh.gateway.chat.pipeline import (
    ChatJob,
    ChatPiece,
    ChatSummary,
    SpokenPiece,
    SpokenText,
    run_chat,
)
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.mesh.calls import CancelScope
from stagemesh.gateway.mesh.events import Output, StageEvent
from stagemesh.gateway.realtime.protocol import (
    PCM_RATE,
    assistant_audio_item,
    new_id,
    pcm_base64,
    server_event,
)
from stagemesh.gateway.wire.requests import JsonObject
from stagemesh.shared.resample import Floats, StreamResampler

log = logging.getLogger(__name__)

#: Sends one server event, unless `unless()` holds once the socket is free; True if sent.
Send = Callable[[JsonObject, Callable[[], bool] | None], Awaitable[bool]]


@dataclass
class SpokenSpan:
    """A sentence of the answer and the audio it had, in ms from the answer's start."""

    text: str
    start_ms: int
    end_ms: int


@dataclass
class AssistantItem:
    id: str
    spans: list[SpokenSpan] = field(default_factory=list)
    text_override: str | None = None  # set by a truncate

    @property
    def text(self) -> str:
        if self.text_override is not None:
            return self.text_override
        return " ".join(span.text for span in self.spans)

    @property
    def audio_ms(self) -> int:
        return self.spans[-1].end_ms if self.spans else 0

    def truncate(self, audio_end_ms: int) -> None:
        """Keep what was heard: whole sentences before `audio_end_ms`, and of the sentence
        playing then, its words in proportion to the audio played."""
        kept = []
        for span in self.spans:
            if span.end_ms <= audio_end_ms:
                kept.append(span.text)
            elif span.start_ms < audio_end_ms:
                words = span.text.split()
                share = (audio_end_ms - span.start_ms) / max(1, span.end_ms - span.start_ms)
                kept.append(" ".join(words[: int(len(words) * share)]))
        self.text_override = " ".join(t for t in kept if t)


class Answer:
    """A response in progress (see the module docstring)."""

    def __init__(self, core: GatewayCore, job: ChatJob, owner: str, send: Send) -> None:
        self.core, self.job, self.owner, self.send = core, job, owner, send
        self.id = new_id("resp")
        self.item = AssistantItem(new_id("item"))
        #: Why the answer stopped early ("turn_detected", "client_cancelled"); None: it runs.
        self.stop_reason: str | None = None
        self._scope: CancelScope | None = None
        self._cancelling: asyncio.Task[object] | None = None
        self._resampler: StreamResampler | None = None
        self._samples = 0  # sent, at PCM_RATE
        self._transcribed = False  # a transcript delta was sent

    def stopped(self) -> bool:
        return self.stop_reason is not None

    def stop(self, reason: str) -> None:
        """Stop now: no audio delta leaves after this call; the stage calls are cancelled."""
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        if self._scope is not None:
            self._cancelling = asyncio.create_task(self._scope.cancel(reason))

    def _where(self) -> JsonObject:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0,
                "content_index": 0}

    def _response(self, status: str, details: JsonObject | None = None,
                  summary: ChatSummary | None = None) -> JsonObject:
        done = status != "in_progress"
        item = assistant_audio_item(self.item.id, self.item.text if done else None,
                                    "completed" if done else "in_progress")
        usage = None if summary is None else {
            "input_tokens": summary.prompt_tokens, "output_tokens": summary.completion_tokens,
            "total_tokens": summary.prompt_tokens + summary.completion_tokens}
        return {"object": "realtime.response", "id": self.id, "status": status,
                "status_details": details, "output": [item] if done else [],
                "output_modalities": ["audio"], "usage": usage,
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": PCM_RATE}}}}

    async def run(self, previous_item_id: str | None) -> AssistantItem:
        """Run to the end (completed, cancelled or failed) and send every event of it."""
        item = assistant_audio_item(self.item.id, None, "in_progress")
        await self.send(server_event("response.created",
                                     response=self._response("in_progress")), None)
        await self.send(server_event("conversation.item.added", item=item,
                                     previous_item_id=previous_item_id), None)
        await self.send(server_event("response.output_item.added", response_id=self.id,
                                     output_index=0, item=item), None)
        await self.send(server_event("response.content_part.added", **self._where(),
                                     part={"type": "audio", "transcript": ""}), None)
        summary, status = None, "completed"
        details: JsonObject | None = None
        try:
            summary = await self._answer()
        except GatewayError as error:
            if self.stop_reason is None:
                status, details = "failed", {"type": "failed", "error": {
                    "type": "server_error", "code": error.code.name.lower(),
                    "message": error.message}}
        if self.stop_reason is not None:
            status, details = "cancelled", {"type": "cancelled", "reason": self.stop_reason}
        else:
            await self._tail()
            if summary is not None and summary.finish_reason == "length":
                status, details = "incomplete", {"type": "incomplete",
                                                 "reason": "max_output_tokens"}
        await self._finish(status, details, summary)
        if self._cancelling is not None:
            await self._cancelling
        return self.item

    async def _answer(self) -> ChatSummary | None:
        context = RequestContext(self.id, None, self.owner)
        async with self.core.request_scope(self.job.recipe, context) as scope:
            self._scope = scope
            if self.stop_reason is not None:  # stopped before it started
                return None
            return await run_chat(self.core, self.job, scope, self._emit)

    async def _emit(self, item: StageEvent | Output[ChatPiece]) -> None:
        if not isinstance(item, Output):
            return
        if isinstance(item.value, SpokenText):  # a piece goes to the talker now
            await self._transcript(item.value.text)
            return
        piece = item.value
        if not isinstance(piece, SpokenPiece):  # the text as written: the pieces carry it
            return
        if self._resampler is None:
            self._resampler = StreamResampler(piece.sample_rate, PCM_RATE)
        if piece.transcript and not self.stopped():  # the sentence's audio starts
            start = self._ms()
            self.item.spans.append(SpokenSpan(piece.transcript, start, start))
        await self._audio(self._resampler.push(piece.pcm))

    async def _transcript(self, sentence: str) -> None:
        """The transcript runs a piece ahead of the audio (the pieces the chat pipeline
        speaks); the item keeps only what was spoken."""
        delta = sentence if not self._transcribed else " " + sentence
        if await self.send(server_event("response.output_audio_transcript.delta",
                                        **self._where(), delta=delta), self.stopped):
            self._transcribed = True

    async def _audio(self, pcm: Floats) -> None:
        if pcm.size == 0:
            return
        if await self.send(server_event("response.output_audio.delta", **self._where(),
                                        delta=pcm_base64(pcm)), self.stopped):
            self._samples += pcm.shape[0]
            if self.item.spans:
                self.item.spans[-1].end_ms = self._ms()

    def _ms(self) -> int:
        return round(1000 * self._samples / PCM_RATE)

    async def _tail(self) -> None:
        if self._resampler is not None:
            await self._audio(self._resampler.push(np.zeros(0, np.float32), final=True))

    async def _finish(self, status: str, details: JsonObject | None,
                      summary: ChatSummary | None) -> None:
        transcript = self.item.text
        item = assistant_audio_item(self.item.id, transcript, "completed")
        where = self._where()
        for event in (
            server_event("response.output_audio.done", **where),
            server_event("response.output_audio_transcript.done", **where,
                         transcript=transcript),
            server_event("response.content_part.done", **where,
                         part={"type": "audio", "transcript": transcript}),
            server_event("response.output_item.done", response_id=self.id, output_index=0,
                         item=item),
            server_event("conversation.item.done", item=item),
            server_event("response.done", response=self._response(status, details, summary)),
        ):
            await self.send(event, None)
