"""The contract between the step-machine engine and a stage's model.

Every stage (Tokenizer, Talker, DiT, VAE, Codec) is one `StageAdapter` driven by the same
engine (`stagemesh.shared.engine.engine.StepEngine`). The engine owns scheduling, cancellation,
deadlines, metrics and event publishing; the adapter owns only the model math.

All adapter methods but `check_inputs` run on the engine's compute thread, never on the asyncio
loop, so they may block on torch. They are never called concurrently.

Life of a request, as the engine sees it::

    check_inputs(payload)           on submit, on the caller's thread (keep it cheap, touch no
                                    state); raises InvalidInputError -> INVALID_ARGUMENT
    state = prepare(request)        once, when first scheduled (never for a request aborted
                                    while waiting)
    add_input(state, payload)       zero or more times, for streamed input (codec frames)
    outputs = step([s1, s2, ...])   repeatedly, one step for every state in the batch
    result = finish(state)          once, after a StepOutput with finished=True
    release(state)                  always, exactly once, when the request leaves the engine
                                    (completed, aborted or failed), in the same tick

Between steps a request may be preempted (paused for a more urgent one) and later resumed: its
state is kept as it is and simply not stepped meanwhile; it is never prepared twice.

What `step` must guarantee:

- A batch holds at most the engine's `max_batch` states, all with equal `batch_key`; which
  states share a call changes from step to step (requests join, leave, pause), so a state's
  result must not depend on its batch mates.
- All or nothing: if `step` raises, it has advanced none of its states (each is as it was
  before the call). The engine relies on this to isolate a failure: it steps the states of a
  batch that raised again, one per call, so only the state that makes it raise fails. Do the
  fallible work (the forward) first and mutate states only once nothing can raise; a per-state
  problem found on the way is that state's `StepOutput.error`, not an exception.
- Stopping part-way: an adapter that implements `interrupt.Interruptible` gets the engine's
  `StepInterrupt` once (`bind_interrupt`); `step` may call its `check()` between layers, which
  raises `StepInterrupted` once every request of the batch is cancelled. Let it propagate; it
  too must leave the states unadvanced. The engine aborts those requests at once; it is never
  a failure.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Never, Protocol, TypeVar

# The five types an adapter fixes, in the order StageAdapter and StepEngine take them:
#   InputT    what a request starts with (a dataclass the servicer builds from `start`)
#   StreamT   streamed input, via add_input (`Never` for stages without streamed input)
#   StateT    what the adapter holds for a request between steps
#   PartialT  a piece of output a step streams out now (`Never` for stages without partials)
#   ResultT   what `finish` returns
InputT = TypeVar("InputT")
StreamT = TypeVar("StreamT")
StateT = TypeVar("StateT")
PartialT = TypeVar("PartialT")
ResultT = TypeVar("ResultT")
# Variance: the read-only records and the protocol only consume inputs and only produce outputs.
InputT_co = TypeVar("InputT_co", covariant=True)
InputT_contra = TypeVar("InputT_contra", contravariant=True)
StreamT_contra = TypeVar("StreamT_contra", contravariant=True)
PartialT_co = TypeVar("PartialT_co", covariant=True)
ResultT_co = TypeVar("ResultT_co", covariant=True)

#: The StreamT / PartialT of stages that take no streamed input or stream no partial output.
NoStream = Never


class InvalidInputError(ValueError):
    """Bad request input; becomes INVALID_ARGUMENT naming `field_name`."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name


class ExecutionMode(enum.Enum):
    """How the engine runs a multi-step request."""

    STEP = "step"  # one step per tick: aborts land at the next step boundary
    REQUEST = "request"  # the whole request in one tick: a running request ignores aborts


@dataclass(frozen=True)
class StepBudget:
    """How many steps a request will take, as far as is known when it is submitted.

    total_steps is None for open-ended work (an autoregressive talker runs until a stop frame
    or max_new_tokens; a streaming codec runs until its input ends).
    """

    total_steps: int | None
    start_step: int = 0


@dataclass(frozen=True)
class EngineRequest(Generic[InputT_co]):
    """What a servicer hands the engine for one request (read-only once built)."""

    request_id: str
    payload: InputT_co  # the adapter's own typed input (a dataclass built by the servicer)
    budget: StepBudget = field(default_factory=lambda: StepBudget(total_steps=1))
    deadline: float | None = None  # time.monotonic() value; None = no deadline
    priority: int = 0  # lower runs first; FIFO among equals
    mode: ExecutionMode | None = None  # None = the engine's default mode


@dataclass(frozen=True)
class StepOutput(Generic[PartialT_co]):
    """One state's outcome of one `step` call (the seed's RunnerOutput).

    step_index: steps completed so far (1 after the first step). None is a bug in the adapter
      and fails that request only ("Missing step_index in step output").
    finished: the request needs no more steps; the engine then calls `finish`.
    partial: an optional piece of output to stream now (codec frames, an audio chunk).
    waiting_for_input: the state cannot advance until `add_input` brings more (streamed input).
    error: the step failed for this request only.
    reused: the step reused cached work instead of computing (a DiT's step cache).
    """

    step_index: int | None
    finished: bool = False
    partial: PartialT_co | None = None
    waiting_for_input: bool = False
    error: str | None = None
    reused: bool = False


class StageAdapter(Protocol[InputT_contra, StreamT_contra, StateT, PartialT_co, ResultT_co]):
    """A stage's model, as a step machine. See the module docstring for the call order."""

    #: Name used in metrics labels and logs, e.g. "dit".
    stage: str

    def check_inputs(self, payload: InputT_contra) -> None:
        """Validate before any compute; raise InvalidInputError naming the field."""
        ...

    def prepare(self, request: EngineRequest[InputT_contra]) -> StateT:
        """One-time work: encode inputs, allocate, seed noise."""
        ...

    def add_input(self, state: StateT, payload: StreamT_contra) -> None:
        """Append streamed input (e.g. more codec frames). Stages without streamed input take
        `NoStream`, so the type checker refuses any call."""
        ...

    def step(self, states: Sequence[StateT]) -> Sequence[StepOutput[PartialT_co]]:
        """Advance every state by one step; return one StepOutput per state, in order.

        All or nothing: if it raises, no state has advanced (see the module docstring)."""
        ...

    def finish(self, state: StateT) -> ResultT_co:
        """The final result of a finished state."""
        ...

    def release(self, state: StateT) -> None:
        """Free what the state holds (latents, KV cache). Called exactly once per state."""
        ...

    def batch_key(self, state: StateT) -> Hashable:
        """States with equal keys may share one `step` call."""
        ...
