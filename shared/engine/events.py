"""What a request's stream yields. Every stream ends with exactly one terminal event.

Every event carries `at`, the `time.monotonic()` at which the engine made it (on its compute
thread, right when the thing happened), so a reader on the event loop can place it in time
however late it reads it: the stage's trace spans are built from these (shared/stage_trace.py).
`at` never takes part in equality.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generic, TypeAlias

from stagemesh.shared.engine.adapter import PartialT, PartialT_co, ResultT, ResultT_co
from stagemesh.shared.engine.request import AbortReason


@dataclass(frozen=True)
class Queued:
    """Admitted to the engine; `position` requests are ahead of it (0 = next to run)."""

    position: int
    at: float = field(default_factory=time.monotonic, compare=False, kw_only=True)


@dataclass(frozen=True)
class PrepareTiming:
    """When the request left the queue for the adapter's `prepare`, and when that returned."""

    started_at: float  # time.monotonic()
    ended_at: float


@dataclass(frozen=True)
class Progress:
    """One step done. total_steps is None for open-ended work."""

    step_index: int
    total_steps: int | None
    step_seconds: float  # duration of the step call that produced this progress
    elapsed_seconds: float  # since the request was submitted
    #: The request's prepare (None if the engine did not say): it splits the time before the
    #: first step into queue wait and prepare, for the stage's trace.
    prepared: PrepareTiming | None = field(default=None, compare=False, kw_only=True)
    #: The step reused cached work instead of computing it (a DiT's step cache).
    reused: bool = field(default=False, kw_only=True)
    at: float = field(default_factory=time.monotonic, compare=False, kw_only=True)


@dataclass(frozen=True)
class Preempted:
    """Paused at a step boundary for a more urgent request, after `step_index` steps.

    Not terminal: the request keeps its state and resumes later; its next Progress says it is
    running again.
    """

    step_index: int
    at: float = field(default_factory=time.monotonic, compare=False, kw_only=True)


@dataclass(frozen=True)
class Partial(Generic[PartialT_co]):
    """A piece of output to stream now (codec frames, an audio chunk)."""

    payload: PartialT_co
    at: float = field(default_factory=time.monotonic, compare=False, kw_only=True)


@dataclass(frozen=True)
class Completed(Generic[ResultT_co]):
    """Terminal: the adapter's `finish` result."""

    result: ResultT_co
    step_index: int
    at: float = field(default_factory=time.monotonic, compare=False, kw_only=True)


@dataclass(frozen=True)
class Aborted:
    """Terminal: stopped at `step_index` steps; latency runs from the abort signal to release."""

    step_index: int
    reason: AbortReason
    abort_latency_seconds: float
    at: float = field(default_factory=time.monotonic, compare=False, kw_only=True)


@dataclass(frozen=True)
class Failed:
    """Terminal: the request failed; field_name is set when bad input caused it."""

    message: str
    field_name: str | None = None
    at: float = field(default_factory=time.monotonic, compare=False, kw_only=True)


#: Everything a request's stream yields; generic in the adapter's partial and result types.
Event: TypeAlias = (
    Queued | Progress | Preempted | Partial[PartialT] | Completed[ResultT] | Aborted | Failed
)
#: The events that end a stream.
Terminal: TypeAlias = Completed[ResultT] | Aborted | Failed
TERMINAL_EVENTS = (Completed, Aborted, Failed)


def is_terminal(event: object) -> bool:
    return isinstance(event, TERMINAL_EVENTS)
