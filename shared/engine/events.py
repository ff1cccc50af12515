"""What a request's stream yields. Every stream ends with exactly one terminal event."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeAlias

from stagemesh.shared.engine.adapter import PartialT, PartialT_co, ResultT, ResultT_co
from stagemesh.shared.engine.request import AbortReason


@dataclass(frozen=True)
class Queued:
    """Admitted to the engine; `position` requests are ahead of it (0 = next to run)."""

    position: int


@dataclass(frozen=True)
class Progress:
    """One step done. total_steps is None for open-ended work."""

    step_index: int
    total_steps: int | None
    step_seconds: float  # duration of the step call that produced this progress
    elapsed_seconds: float  # since the request was submitted


@dataclass(frozen=True)
class Preempted:
    """Paused at a step boundary for a more urgent request, after `step_index` steps.

    Not terminal: the request keeps its state and resumes later; its next Progress says it is
    running again.
    """

    step_index: int


@dataclass(frozen=True)
class Partial(Generic[PartialT_co]):
    """A piece of output to stream now (codec frames, an audio chunk)."""

    payload: PartialT_co


@dataclass(frozen=True)
class Completed(Generic[ResultT_co]):
    """Terminal: the adapter's `finish` result."""

    result: ResultT_co
    step_index: int


@dataclass(frozen=True)
class Aborted:
    """Terminal: stopped at `step_index` steps; latency runs from the abort signal to release."""

    step_index: int
    reason: AbortReason
    abort_latency_seconds: float


@dataclass(frozen=True)
class Failed:
    """Terminal: the request failed; field_name is set when bad input caused it."""

    message: str
    field_name: str | None = None


#: Everything a request's stream yields; generic in the adapter's partial and result types.
Event: TypeAlias = (
    Queued | Progress | Preempted | Partial[PartialT] | Completed[ResultT] | Aborted | Failed
)
#: The events that end a stream.
Terminal: TypeAlias = Completed[ResultT] | Aborted | Failed
TERMINAL_EVENTS = (Completed, Aborted, Failed)


def is_terminal(event: object) -> bool:
    return isinstance(event, TERMINAL_EVENTS)
