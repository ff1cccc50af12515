"""A request's lifecycle inside one stage engine: its state, why it was aborted, its record."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from stagemesh.shared.engine.adapter import EngineRequest


class RequestState(enum.IntEnum):
    """Lifecycle order: live states first, so `is_finished` is one comparison.

    WAITING -> RUNNING <-> PREEMPTED -> FINISHED_COMPLETED | FINISHED_ABORTED | FINISHED_ERROR
    """

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_COMPLETED = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestState.PREEMPTED


class AbortReason(enum.Enum):
    """Why a request was aborted; servicers map it to a gRPC code."""

    CANCELLED = "cancelled"  # a Cancel message or an explicit cancel
    RPC_CANCELLED = "rpc_cancelled"  # the RPC ended: the client went away
    DEADLINE_EXCEEDED = "deadline_exceeded"
    SHUTDOWN = "shutdown"  # the engine is stopping and aborts in-flight work


@dataclass
class RequestRecord:
    """The scheduler's bookkeeping for one request. Times are `time.monotonic()` values.

    The scheduler never reads a payload, so it holds every request as EngineRequest[object].
    """

    request: EngineRequest[object]
    arrival: int  # admission order, the FIFO tie-breaker among equal priorities
    state: RequestState = RequestState.WAITING
    step_index: int = 0  # steps completed so far (starts at the budget's start_step)
    prepared: bool = False  # the adapter holds a state for it; set once, kept over preemption
    batch_key: Hashable = None  # meaningful only once prepared
    waiting_for_input: bool = False  # not stepped until `add_input` brings more
    # Input arrived since the request was last scheduled: a step that reported "waiting for
    # input" did so before seeing it, so that report must not put the request to sleep.
    input_since_schedule: bool = False
    error: str | None = None  # set for FINISHED_ERROR only
    error_field: str | None = None  # the input field an error is about, when there is one
    abort_reason: AbortReason | None = None  # set for FINISHED_ABORTED only
    submitted_at: float = field(default_factory=time.monotonic)
    first_scheduled_at: float | None = None
    abort_signal_at: float | None = None  # when the abort was asked for (or the deadline)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_finished(self) -> bool:
        return self.state.is_finished
