"""Stopping a step part-way: the one channel from `StepEngine.abort` into a running forward.

A step holds the compute thread for a whole forward pass; the control queue is drained only
between steps. When every request in the running batch has been cancelled, nobody wants the
step's output, so an adapter that can stop between layers (the DiT, between transformer
blocks) asks `StepInterrupt.requested()` there and raises `StepInterrupted`. The engine then
retires the batch as aborted at once instead of finishing the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol, runtime_checkable


class StepInterrupted(Exception):
    """Raised by an adapter's `step` when `StepInterrupt.requested()` turned true mid-step."""


class StepInterrupt:
    """Which requests of the step in flight have been cancelled (thread-safe).

    The engine `arm`s it with the batch's ids before `adapter.step` and `disarm`s it after;
    `cancel` is called from any thread as an abort arrives; `requested` is true once every
    request of the armed batch is cancelled (a step that still serves someone runs to its end).

    A cancel that lands between two steps (after `disarm`, before the next `arm`) is kept and
    counts for the next armed batch if that batch holds its id, so no cancel falls through the
    gap between the engine draining its control queue and arming the next step. Cancels from
    before the last `disarm` are forgotten: the engine has drained their control messages at
    that step boundary.
    """

    #: Cancels kept between two steps, at most (an idle engine is not armed for a long time);
    #: one over it is not kept, so its abort lands at the next step boundary instead.
    MAX_KEPT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batch: frozenset[str] = frozenset()
        self._cancelled: set[str] = set()
        self._everything = False  # cancel_all since the last disarm

    def arm(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._batch = frozenset(request_ids)
            self._cancelled &= self._batch

    def disarm(self) -> None:
        with self._lock:
            self._batch = frozenset()
            self._cancelled = set()
            self._everything = False

    def cancel(self, request_id: str) -> None:
        with self._lock:
            between_steps = not self._batch and len(self._cancelled) < self.MAX_KEPT
            if request_id in self._batch or between_steps:
                self._cancelled.add(request_id)

    def cancel_all(self) -> None:
        """Every request of the step in flight (or of the next one) is cancelled: shutdown."""
        with self._lock:
            self._everything = True

    def requested(self) -> bool:
        with self._lock:
            return bool(self._batch) and (self._everything or self._cancelled >= self._batch)

    def check(self) -> None:
        """Raise StepInterrupted if the whole batch is cancelled (call between layers)."""
        if self.requested():
            raise StepInterrupted


@runtime_checkable
class Interruptible(Protocol):
    """An adapter whose `step` can stop part-way; the engine binds its StepInterrupt once."""

    def bind_interrupt(self, interrupt: StepInterrupt) -> None: ...
