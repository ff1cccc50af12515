"""A realtime session's ears: the Transcriber stage's VAD and transcripts, over its audio.

With server VAD on, the session's audio flows into one `Transcribe` call as it arrives (the
stage runs the VAD: the gateway runs no models); its speech_started / speech_stopped events and
final segments go to the session's `Turns`. A call carries at most the stage's `max_seconds`
of audio: before that, or when the client commits, the call gets its final input (the stage
closes an open segment) and the next audio opens a new call; times stay the session's. A
partial segment is the open turn's early text (the call asks for it: `early_partials`), which
the session may answer before the turn ends (speculation.py). With VAD off, a commit transcribes
the buffered audio in one call (`transcribe_buffer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import numpy as np

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.mesh.calls import call_stage
from stagemesh.gateway.mesh.stubs import transcriber_stub
from stagemesh.gateway.realtime.protocol import PCM_RATE, Pcm16, ServerVad, new_id
from stagemesh.gateway.recipes import Recipe
from stagemesh.gateway.transcriptions.pipeline import TranscribeCall, prepare_audio, transcribe
from stagemesh.gateway.transcriptions.protocol import DecodedAudio
from stagemesh.shared.proto.v1 import transcriber_service_pb2 as pb
from stagemesh.shared.resample import Floats, StreamResampler
from stagemesh.shared.tensors import array_to_proto

log = logging.getLogger(__name__)

#: A listening call's time budget; it is replaced well before (CALL_MAX_AGE_S).
CALL_TIMEOUT_S = 3600.0
CALL_MAX_AGE_S = 3000.0
#: After a failed call (the stage full or down), audio is dropped this long before the next
#: call is tried: one error event a second at most, not one per append.
RETRY_AFTER_S = 1.0
#: PCM16 full scale.
_INT16_SCALE = 32768.0


class Turns(Protocol):
    """What the session does with what the stage hears (times in ms of session audio)."""

    async def speech_started(self, audio_start_ms: int) -> None: ...

    async def speech_stopped(self, audio_end_ms: int) -> None: ...

    async def early_text(self, text: str) -> None: ...

    async def heard(self, text: str) -> None: ...

    async def listening_failed(self, error: GatewayError) -> None: ...


def _floats(pcm: Pcm16) -> Floats:
    return pcm.astype(np.float32) / np.float32(_INT16_SCALE)


class _Call:
    """One Transcribe call: its own audio queue, and where its audio starts in the session."""

    def __init__(self, offset_ms: int, rate: int) -> None:
        self.offset_ms = offset_ms
        self.queue: asyncio.Queue[Pcm16 | None] = asyncio.Queue()
        self.samples = 0  # at PCM_RATE
        self.opened = time.monotonic()
        self.resampler = StreamResampler(PCM_RATE, rate)
        self.task: asyncio.Task[None] | None = None

    async def pump(self, call: TranscribeCall) -> None:
        while True:
            pcm = await self.queue.get()
            if pcm is None:
                last = pb.TranscribeInput(final=True)
                tail = self.resampler.push(np.zeros(0, np.float32), final=True)
                if tail.size and not self.resampler.identity:
                    last.pcm.CopyFrom(array_to_proto(tail))
                await call.write(pb.TranscribeRequest(input=last))
                return
            if self.resampler.identity:
                piece = array_to_proto(pcm)  # PCM16 as it came: the stage takes int16
            else:
                piece = array_to_proto(self.resampler.push(_floats(pcm)))
            await call.write(pb.TranscribeRequest(input=pb.TranscribeInput(pcm=piece)))


class VadListener:
    """Feeds the session's audio to the Transcriber, one call at a time (see the module)."""

    def __init__(self, core: GatewayCore, recipe: Recipe, vad: ServerVad, turns: Turns,
                 owner: str) -> None:
        self.core, self.recipe, self.vad, self.turns, self.owner = (
            core, recipe, vad, turns, owner)
        self.received = 0  # session samples, at PCM_RATE
        self._call: _Call | None = None
        #: Every call still running: the current one, and flushed ones still decoding.
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed_at = -RETRY_AFTER_S

    async def feed(self, pcm: Pcm16) -> None:
        facts = await self.core.catalog.read(self.core.catalog.transcriber, self.recipe)
        call = self._call
        limit = int(facts.max_seconds * PCM_RATE) - pcm.shape[0]
        if call is not None and (call.samples > limit or call.task is None or call.task.done()
                                 or time.monotonic() - call.opened > CALL_MAX_AGE_S):
            self.flush()
            call = None
        if call is None and time.monotonic() - self._failed_at < RETRY_AFTER_S:
            self.received += pcm.shape[0]  # heard by no one: the failure was reported
            return
        if call is None:
            rate = PCM_RATE if PCM_RATE in facts.sample_rates else facts.model_sample_rate
            call = self._call = _Call(round(1000 * self.received / PCM_RATE), rate)
            call.task = asyncio.create_task(self._run(call, rate))
            self._tasks.add(call.task)
            call.task.add_done_callback(self._tasks.discard)
        call.queue.put_nowait(pcm)
        call.samples += pcm.shape[0]
        self.received += pcm.shape[0]

    def flush(self) -> None:
        """End the current call's audio: the stage closes an open segment and decodes it."""
        if self._call is not None:
            self._call.queue.put_nowait(None)
            self._call = None

    async def close(self) -> None:
        """Stop listening now (the socket closed, VAD changed, the buffer cleared): every
        call is cancelled, the audio the stage holds is dropped."""
        self._call = None
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, call: _Call, rate: int) -> None:
        context = RequestContext(new_id("listen"), CALL_TIMEOUT_S, self.owner)
        start = pb.TranscribeStart(
            sample_rate=rate, vad=pb.VAD_MODE_ON, partial_interval_ms=-1, early_partials=True,
            silence_duration_ms=self.vad.silence_duration_ms, vad_threshold=self.vad.threshold)

        async def on_event(stage: str, response: pb.TranscribeResponse) -> None:
            match response.WhichOneof("event"):
                case "speech_started":
                    await self.turns.speech_started(
                        call.offset_ms + response.speech_started.audio_start_ms)
                case "speech_stopped":
                    await self.turns.speech_stopped(
                        call.offset_ms + response.speech_stopped.audio_end_ms)
                case "segment" if response.segment.final:
                    await self.turns.heard(response.segment.text.strip())
                case "segment":  # a pause's early text ("" = withdrawn): likely the final
                    await self.turns.early_text(response.segment.text.strip())

        try:
            async with self.core.request_scope(self.recipe, context) as scope:
                start.request_id = scope.stage_request_id
                stub = transcriber_stub(self.core.mesh.channel(self.recipe.stage("transcriber")))
                await call_stage(scope, "transcriber", stub.Transcribe,
                                 pb.TranscribeRequest(start=start), pb.TranscribeRequest,
                                 on_event=on_event, pump_inputs=call.pump)
        except GatewayError as error:
            self._failed_at = time.monotonic()
            log.info("realtime listening call failed: %s", error.message)
            await self.turns.listening_failed(error)


async def transcribe_buffer(core: GatewayCore, recipe: Recipe, pcm: Pcm16,
                            owner: str) -> str:
    """VAD off: the committed buffer transcribed in one call."""
    audio = DecodedAudio(_floats(pcm), PCM_RATE)
    job = await prepare_audio(core, recipe, audio, "input_audio_buffer")
    transcript = await transcribe(core, job, RequestContext(new_id("listen"), None, owner))
    return transcript.text
