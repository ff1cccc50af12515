"""Speculative end of turn: a turn's answer starts at the pause, before the turn is confirmed.

With server VAD, the Transcriber decodes an open turn early, once its pause reaches 100 ms
(the audio a close keeps after it), and (`TranscribeStart.early_partials`, which the session's
listening call sets) sends that text as a partial: it is the turn's final text if the pause
lasts `silence_duration_ms`. The session answers it at once, as it would answer
the confirmed turn, but *held*: every event the answer produces (response.created, the
transcript and audio deltas, ...) is kept back, the answer's item is not in the conversation,
and its audio is never played. Then:

- the turn is confirmed (its final text arrives) and the answer was started on exactly the
  thinker input the confirmed turn gives (the same conversation, text and settings): the
  answer joins the conversation and its held events are sent, in order, at once; later ones
  pass straight through, so the client sees what a non-speculative answer sends, sooner;
- otherwise (speech resumed, and the stage withdrew the text; another text; a different final
  text; the conversation or the session settings changed; the buffer cleared; the socket
  closed): the answer is cancelled like a barge-in (every stage call ends at its next step)
  and its held events are dropped: no event, no history.

The rules: an answer is only held while no other answer runs; one speculation at a time;
the audio of an answer is never sent before its turn is confirmed.

The gateway's /metrics count how each turn's answer started (`speculative`: a held answer
confirmed) and how much audio the session received between a held answer's start and its
confirmation (its lead over an answer started at the confirmation), and the dropped ones.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from stagemesh.gateway.chat.protocol import ChatTurn
from stagemesh.gateway.realtime.answer import Answer, Send
from stagemesh.gateway.realtime.protocol import SessionConfig
from stagemesh.gateway.wire.requests import JsonObject

#: The stop reason of a speculative answer that is dropped (never sent to the client).
DROPPED = "speculation_dropped"

TURN_ANSWERS = Counter(
    "stagemesh_realtime_turn_answers_total",
    "Realtime turns answered when server VAD ended them, by whether the answer was a held "
    "speculation (started at the pause) or started at the confirmation.",
    ["recipe", "speculative"])
SPECULATION_LEAD = Histogram(
    "stagemesh_realtime_speculation_lead_seconds",
    "Audio a realtime session received between a held answer's start and its turn's "
    "confirmation: how much sooner it started than an answer started at the confirmation.",
    ["recipe"], buckets=(0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.75, 1.0))
SPECULATIONS_DROPPED = Counter(
    "stagemesh_realtime_speculations_dropped_total",
    "Held answers cancelled unheard (speech resumed, another text, a changed conversation).",
    ["recipe"])


class _Gate(enum.Enum):
    HOLD = enum.auto()  # events are kept
    FLUSH = enum.auto()  # the kept events are being sent; new ones queue behind them
    OPEN = enum.auto()  # events pass through
    SHUT = enum.auto()  # events are dropped


class HeldSend:
    """A Send that keeps events until `release` (then sends them in order, and lets later ones
    through) or `discard` (then drops them all). A kept event counts as sent: it is sent at
    the release, unless its answer was stopped by then (each event's own `unless`)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._held: collections.deque[tuple[JsonObject, Callable[[], bool] | None]] = (
            collections.deque())
        self._gate = _Gate.HOLD

    async def __call__(self, event: JsonObject, unless: Callable[[], bool] | None) -> bool:
        if self._gate is _Gate.OPEN:
            return await self._send(event, unless)
        if self._gate is _Gate.SHUT:
            return False
        self._held.append((event, unless))
        return True

    async def release(self) -> None:
        self._gate = _Gate.FLUSH
        while self._held:
            await self._send(*self._held.popleft())
        self._gate = _Gate.OPEN

    def discard(self) -> None:
        self._gate = _Gate.SHUT
        self._held.clear()


@dataclass
class Speculation:
    """An answer started on a turn's early text, held until the turn is confirmed."""

    text: str  # the early text it answers
    turns: tuple[ChatTurn, ...]  # the thinker's input it was started with
    config: SessionConfig  # the session's settings then
    previous: str  # the item it follows: the turn's user item
    answer: Answer
    gate: HeldSend
    task: asyncio.Task[None]
    heard_samples: int  # session audio received when it started

    def answers(self, turns: tuple[ChatTurn, ...], config: SessionConfig,
                last_id: str | None) -> bool:
        """Whether it is the answer the confirmed turn would start: the same thinker input
        and settings, after the same item."""
        return self.turns == turns and self.config == config and self.previous == last_id

    def drop(self) -> None:
        """Cancel its stage calls (each ends at its next step) and drop its events."""
        self.gate.discard()
        self.answer.stop(DROPPED)
