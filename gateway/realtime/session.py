"""One realtime session: its settings, its conversation, its ears and its current answer.

Client events are handled one at a time, in order (`handle`); the Transcriber's events arrive
on the listening call's task (`Turns`). With server VAD a turn is: speech_started (a new user
item id; an answer playing is stopped when `interrupt_response`), speech_stopped (the item
committed and added), its final transcript (`...input_audio_transcription.completed`, item
done), then, with `create_response`, the answer. With the stage's early texts, that answer
starts at the pause and is held until the turn is confirmed (speculation.py). The
conversation is one history per session; each answer is given the newest items that fit the
thinker's published limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stagemesh.gateway.chat.pipeline import ChatJob, prepare_chat
from stagemesh.gateway.chat.protocol import AudioOutput, ChatRequest, ChatTurn
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.realtime.answer import Answer, AssistantItem, Send
from stagemesh.gateway.realtime.listening import VadListener, transcribe_buffer
from stagemesh.gateway.realtime.protocol import (
    PCM_RATE,
    Append,
    Clear,
    ClientEvent,
    Commit,
    ItemCreate,
    Pcm16,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    SessionConfig,
    SessionUpdate,
    Truncate,
    new_id,
    server_event,
    session_object,
    text_item,
    user_audio_item,
)
from stagemesh.gateway.realtime.speculation import (
    SPECULATION_LEAD,
    SPECULATIONS_DROPPED,
    TURN_ANSWERS,
    HeldSend,
    Speculation,
)
from stagemesh.gateway.recipes import Recipe, Task

log = logging.getLogger(__name__)

#: Items a session keeps (the thinker is given the newest that fit its limits).
MAX_ITEMS = 256


@dataclass
class Item:
    """A conversation item: user or system text (typed or heard), or an answer."""

    id: str
    role: str
    text: str = ""
    answer: AssistantItem | None = None

    def content(self) -> str:
        return self.answer.text if self.answer is not None else self.text


class Conversation:
    """The session's one history, oldest first, bounded by MAX_ITEMS."""

    def __init__(self) -> None:
        self.items: list[Item] = []

    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def add(self, item: Item, after: str | None = None) -> str | None:
        """Insert `item` after item `after` (None: at the end); returns its previous id."""
        if self.find(item.id) is not None:
            raise RealtimeError(f"an item with id {item.id!r} exists", "item.id",
                                "item_id_taken")
        at = len(self.items)
        if after is not None:
            found = self.find(after)
            if found is None:
                raise RealtimeError(f"no item with id {after!r}", "previous_item_id",
                                    "item_not_found")
            at = self.items.index(found) + 1
        previous = self.items[at - 1].id if at > 0 else None
        self.items.insert(at, item)
        del self.items[:-MAX_ITEMS]
        return previous

    def find(self, item_id: str) -> Item | None:
        return next((item for item in self.items if item.id == item_id), None)

    def turns(self, instructions: str, max_messages: int, max_chars: int,
              extra: Sequence[Item] = ()) -> tuple[ChatTurn, ...]:
        """The instructions, then the newest items (and `extra` after them, as if added) that
        fit the thinker's limits."""
        head = [ChatTurn("system", instructions)] if instructions else []
        budget = max_chars - len(instructions)
        kept: list[ChatTurn] = []
        for item in reversed([*self.items, *extra]):
            text = item.content()
            if not text:
                continue
            if len(kept) + len(head) >= max_messages or len(text) > budget:
                break
            kept.append(ChatTurn(item.role, text))
            budget -= len(text)
        return (*head, *reversed(kept))


def _hearing(config: SessionConfig) -> tuple[int, float] | None:
    """What a listening call is started with (create/interrupt_response are the session's)."""
    vad = config.turn_detection
    return None if vad is None else (vad.silence_duration_ms, vad.threshold)


class RealtimeSession:
    """A session over a chat recipe (see the module docstring)."""

    def __init__(self, core: GatewayCore, recipe: Recipe, owner: str, send: Send,
                 max_buffer_seconds: float) -> None:
        self.core, self.recipe, self.owner = core, recipe, owner
        self.send = send
        #: Audio the client may buffer before a commit, with VAD off (the listener's own
        #: limit, its max_seconds, is checked at the commit).
        self.max_buffer_samples = int(max_buffer_seconds * PCM_RATE)
        self.id = new_id("sess")
        self.config = SessionConfig()
        self.conversation = Conversation()
        self.listener_recipe = core.mesh.recipe(recipe.listen, Task.SPEECH_TO_TEXT)
        self._buffer: list[Pcm16] = []  # VAD off: audio until a commit
        self._buffered = 0
        self._listener: VadListener | None = None
        self._turn: str | None = None  # the user item being spoken (VAD on)
        self._started_at = 0  # its speech_started, ms of session audio
        self._stopped_at: int | None = None  # speech_stopped of that item, awaiting its text
        self._heard: list[str] = []
        self.answer: Answer | None = None
        self._answering: asyncio.Task[None] | None = None
        self._speculation: Speculation | None = None  # an answer held until its turn ends
        self._dropped: set[asyncio.Task[None]] = set()  # dropped speculations, ending
        self.closed = False

    @property
    def busy(self) -> bool:
        """An answer is running (the session is not idle even if the client is silent)."""
        return self._answering is not None and not self._answering.done()

    async def open(self) -> None:
        await self._event("session.created", session=self._session())

    async def close(self) -> None:
        """The socket closed: every stage call of the session stops now."""
        self.closed = True  # and no answer starts from a transcript still on its way
        self._drop_speculation()
        for task in (self._answering, *self._dropped):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._listener is not None:
            await self._listener.close()

    def _session(self) -> dict[str, object]:
        return session_object(self.id, self.recipe.name, self.config)

    async def _event(self, kind: str, **fields: object) -> None:
        await self.send(server_event(kind, **fields), None)

    # -- client events -------------------------------------------------------------------------

    async def handle(self, event: ClientEvent) -> None:
        match event:
            case SessionUpdate(config):
                await self._update(config)
            case Append(pcm):
                await self._append(pcm)
            case Commit():
                await self._commit()
            case Clear():
                await self._clear()
            case ItemCreate():
                await self._create_item(event)
            case Truncate():
                await self._truncate(event)
            case ResponseCreate():
                await self._respond(event)
            case ResponseCancel(response_id):
                await self._cancel(response_id)

    async def _update(self, config: SessionConfig) -> None:
        if _hearing(config) != _hearing(self.config) and self._listener is not None:
            self._drop_speculation()
            await self._listener.close()  # the next audio opens a call with the new settings
            self._listener = None
        elif self._listener is not None and config.turn_detection is not None:
            self._listener.vad = config.turn_detection
        self.config = config
        await self._event("session.updated", session=self._session())

    async def _append(self, pcm: Pcm16) -> None:
        vad = self.config.turn_detection
        if vad is None:
            if self._buffered + pcm.shape[0] > self.max_buffer_samples:
                raise RealtimeError(f"the input audio buffer holds at most "
                                    f"{self.max_buffer_samples / PCM_RATE:g} s; commit or "
                                    "clear it", "audio", "input_audio_buffer_full")
            self._buffer.append(pcm)
            self._buffered += pcm.shape[0]
            return
        if self._listener is None:
            self._listener = VadListener(self.core, self.listener_recipe, vad, self, self.owner)
        await self._listener.feed(pcm)

    async def _commit(self) -> None:
        if self.config.turn_detection is not None:
            if self._listener is not None:
                self._listener.flush()  # the stage closes the open turn: its events follow
            return
        if not self._buffered:
            raise RealtimeError("the input audio buffer is empty", None,
                                "input_audio_buffer_commit_empty")
        pcm = np.concatenate(self._buffer)
        self._buffer, self._buffered = [], 0
        item = Item(new_id("item"), "user")
        previous = self.conversation.add(item)
        await self._event("input_audio_buffer.committed", item_id=item.id,
                          previous_item_id=previous)
        await self._event("conversation.item.added", previous_item_id=previous,
                          item=user_audio_item(item.id, None, "in_progress"))
        try:
            item.text = await transcribe_buffer(self.core, self.listener_recipe, pcm,
                                                self.owner)
        except GatewayError as error:
            raise RealtimeError(error.message, error.field_name, "transcription_failed"
                                ) from None
        await self._transcribed(item, pcm.shape[0] / PCM_RATE)

    async def _transcribed(self, item: Item, seconds: float) -> None:
        await self._event("conversation.item.input_audio_transcription.completed",
                          item_id=item.id, content_index=0, transcript=item.text,
                          usage={"type": "duration", "seconds": round(seconds, 3)})
        await self._event("conversation.item.done",
                          item=user_audio_item(item.id, item.text, "completed"))

    async def _clear(self) -> None:
        self._drop_speculation()
        self._buffer, self._buffered = [], 0
        if self._listener is not None:  # VAD: the audio the stage holds is dropped with it
            await self._listener.close()
            self._listener = None
        self._turn, self._stopped_at, self._heard = None, None, []
        await self._event("input_audio_buffer.cleared")

    async def _create_item(self, event: ItemCreate) -> None:
        item = Item(event.item_id or new_id("item"), event.role, event.text)
        previous = self.conversation.add(item, event.previous_item_id)
        body = text_item(item.id, item.role, item.text)
        await self._event("conversation.item.added", previous_item_id=previous, item=body)
        await self._event("conversation.item.done", previous_item_id=previous, item=body)

    async def _truncate(self, event: Truncate) -> None:
        item = self.conversation.find(event.item_id)
        if item is None or item.answer is None:
            raise RealtimeError(f"no assistant audio item with id {event.item_id!r}",
                                "item_id", "item_not_found")
        if event.audio_end_ms > item.answer.audio_ms:
            raise RealtimeError(f"audio_end_ms {event.audio_end_ms} is past the item's "
                                f"{item.answer.audio_ms} ms of audio", "audio_end_ms")
        item.answer.truncate(event.audio_end_ms)
        await self._event("conversation.item.truncated", item_id=item.id, content_index=0,
                          audio_end_ms=event.audio_end_ms)

    async def _respond(self, event: ResponseCreate) -> None:
        self._drop_speculation()  # the client answers the conversation its own way
        if self.busy:
            raise RealtimeError("a response is in progress; cancel it first", None,
                                "conversation_already_has_active_response")
        config = self.config
        if event.instructions is not None or event.max_output_tokens is not None:
            config = dataclasses.replace(
                config, instructions=config.instructions if event.instructions is None
                else event.instructions, max_output_tokens=config.max_output_tokens
                if event.max_output_tokens is None else event.max_output_tokens)
        await self._start_answer(config)

    async def _cancel(self, response_id: str | None) -> None:
        answer = self.answer if self.busy else None
        if answer is None or (response_id is not None and response_id != answer.id):
            raise RealtimeError("no response in progress" if answer is None else
                                f"response {response_id!r} is not in progress",
                                "response_id" if response_id else None,
                                "response_cancel_not_active")
        answer.stop("client_cancelled")

    async def _start_answer(self, config: SessionConfig) -> None:
        """Check the request against the stages (a refusal is an error event), then run."""
        if self.closed:
            return
        if not any(item.role == "user" and item.text for item in self.conversation.items):
            raise RealtimeError("the conversation has nothing to answer yet", None,
                                "conversation_empty")
        job = await self._prepare(config, await self._thinker_turns(config))
        answer = self.answer = Answer(self.core, job, self.owner, self.send)
        self._answering = asyncio.create_task(self._run_answer(answer, self._add(answer)))

    async def _thinker_turns(self, config: SessionConfig, extra: Sequence[Item] = ()
                             ) -> tuple[ChatTurn, ...]:
        """What the thinker is given: the conversation (and `extra`) within its limits."""
        facts = await self.core.catalog.read(self.core.catalog.thinker, self.recipe)
        return self.conversation.turns(config.instructions, facts.max_messages,
                                       facts.max_input_chars, extra)

    async def _prepare(self, config: SessionConfig, turns: tuple[ChatTurn, ...]) -> ChatJob:
        try:
            job = await prepare_chat(self.core, self.recipe, ChatRequest(
                messages=turns, model=self.recipe.name,
                max_tokens=config.max_output_tokens or None,
                audio=AudioOutput(voice=config.voice, format="pcm16")))
        except GatewayError as error:
            param = {"audio.voice": "session.audio.output.voice",
                     "max_tokens": "session.max_output_tokens"}.get(error.field_name or "")
            raise RealtimeError(error.message, param or error.field_name) from None
        return dataclasses.replace(job, first_clause=True)  # a turn's answer starts sooner

    def _add(self, answer: Answer) -> str | None:
        """The answer's item joins the conversation; returns the item before it."""
        return self.conversation.add(Item(answer.item.id, "assistant", answer=answer.item))

    async def _run_answer(self, answer: Answer, previous: str | None) -> None:
        try:
            await answer.run(previous)
        except Exception:  # the socket went away mid-answer; the session closes
            log.exception("realtime answer %s ended by an error", answer.id)

    # -- speculative end of turn (speculation.py) ------------------------------------------------

    def _may_speculate(self, turn: str | None) -> bool:
        """A turn is open (not yet stopped), its answer would start by itself, and no other
        answer runs."""
        vad = self.config.turn_detection
        return (vad is not None and vad.create_response and not self.closed and not self.busy
                and turn is not None and turn == self._turn and self._stopped_at is None)

    async def _speculate(self, text: str) -> None:
        """Answer the open turn's early text now, held until the turn is confirmed."""
        turn, config = self._turn, self.config
        if turn is None:
            return
        turns = await self._thinker_turns(config, (Item(turn, "user", text),))
        try:
            job = await self._prepare(config, turns)
        except RealtimeError:
            return  # the confirmed turn's answer reports it
        if not self._may_speculate(turn) or self._speculation is not None:
            return  # the turn moved on while the request was checked
        gate = HeldSend(self.send)
        answer = Answer(self.core, job, self.owner, gate)
        task = asyncio.create_task(self._run_answer(answer, turn))
        self._speculation = Speculation(text, turns, config, turn, answer, gate, task,
                                        self._heard_samples())

    def _heard_samples(self) -> int:
        """Session audio the listener has received, at PCM_RATE."""
        return self._listener.received if self._listener is not None else 0

    async def _confirm_speculation(self) -> bool:
        """The confirmed turn's answer is the held one if that answers exactly this
        conversation: it joins the conversation and its events leave, in order."""
        spec, self._speculation = self._speculation, None
        if spec is None:
            return False
        turns = await self._thinker_turns(self.config)
        if (self.closed or self.busy or spec.answer.stopped()
                or not spec.answers(turns, self.config, self.conversation.last_id())):
            self._drop(spec)
            return False
        self.answer, self._answering = spec.answer, spec.task
        self._add(spec.answer)
        SPECULATION_LEAD.labels(self.recipe.name).observe(
            (self._heard_samples() - spec.heard_samples) / PCM_RATE)
        await spec.gate.release()
        return True

    def _drop_speculation(self) -> None:
        spec, self._speculation = self._speculation, None
        if spec is not None:
            self._drop(spec)

    def _drop(self, spec: Speculation) -> None:
        """Cancel a speculation: no event of it leaves, nothing of it stays in history."""
        spec.drop()
        SPECULATIONS_DROPPED.labels(self.recipe.name).inc()
        self._dropped.add(spec.task)
        spec.task.add_done_callback(self._dropped.discard)

    # -- what the Transcriber hears (Turns) ----------------------------------------------------

    async def speech_started(self, audio_start_ms: int) -> None:
        vad = self.config.turn_detection
        if self.busy and self.answer is not None and (vad is None or vad.interrupt_response):
            self.answer.stop("turn_detected")  # before the event: no delta follows it
        await self._end_turn()  # a stop whose transcript never came
        self._drop_speculation()
        self._turn, self._heard, self._started_at = new_id("item"), [], audio_start_ms
        await self._event("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms,
                          item_id=self._turn)

    async def early_text(self, text: str) -> None:
        """The open turn's likely transcript, at a pause ("": withdrawn, speech resumed)."""
        spec = self._speculation
        if spec is not None and spec.text != text:
            self._drop_speculation()
        if text and self._speculation is None and self._may_speculate(self._turn):
            await self._speculate(text)

    async def speech_stopped(self, audio_end_ms: int) -> None:
        turn = self._turn or new_id("item")
        self._turn, self._stopped_at = turn, audio_end_ms
        await self._event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms,
                          item_id=turn)
        previous = self.conversation.add(Item(turn, "user"))
        await self._event("input_audio_buffer.committed", item_id=turn,
                          previous_item_id=previous)
        await self._event("conversation.item.added", previous_item_id=previous,
                          item=user_audio_item(turn, None, "in_progress"))

    async def heard(self, text: str) -> None:
        if text:
            self._heard.append(text)
        if self._stopped_at is not None:
            await self._end_turn()

    async def _end_turn(self) -> None:
        """The stopped turn's transcript is complete: item done, and the answer (the held
        one, when it answers exactly this turn)."""
        turn, stopped = self._turn, self._stopped_at
        if turn is None or stopped is None:
            return
        self._turn, self._stopped_at = None, None
        item = self.conversation.find(turn)
        if item is None:
            self._drop_speculation()
            return
        item.text, self._heard = " ".join(self._heard), []
        await self._transcribed(item, max(0, stopped - self._started_at) / 1000)
        vad = self.config.turn_detection
        if self.busy and self.answer is not None and self.answer.stopped():
            assert self._answering is not None
            await asyncio.wait({self._answering})  # a barged-in answer ends within a step
        if not (item.text and vad is not None and vad.create_response and not self.busy):
            self._drop_speculation()
        elif await self._confirm_speculation():
            TURN_ANSWERS.labels(self.recipe.name, "true").inc()
        else:
            try:
                await self._start_answer(self.config)
            except RealtimeError as error:
                await self.send(error.event(), None)
            else:
                TURN_ANSWERS.labels(self.recipe.name, "false").inc()

    async def listening_failed(self, error: GatewayError) -> None:
        self._drop_speculation()
        await self.send(RealtimeError(f"listening failed: {error.message}", None,
                                      "transcription_failed").event(), None)
