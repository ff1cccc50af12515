"""The scheduler plans each tick of a stage engine; it never calls the model.

The engine calls, on its compute thread only:

- `add_request` when a submit is drained from the control queue;
- `schedule` once per tick, to learn whom to prepare and which batches to step;
- `mark_prepared` after `adapter.prepare`, so the request is stepped from the next tick on;
- `update_from_output` after the tick's steps, once cancels have been drained again;
- `finish_requests` for every abort (cancel, deadline, shutdown) and every engine-side failure;
- `pop` when the engine has released a finished request and published its terminal event.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Hashable, Mapping, Sized
from dataclasses import dataclass, field

from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, StepOutput
from stagemesh.shared.engine.request import AbortReason, RequestRecord, RequestState

MISSING_STEP_INDEX = "Missing step_index in step output"
MISSING_OUTPUT = "No output for request"


@dataclass
class TickPlan:
    """What one tick does, in order: prepare, then one `step` call per batch."""

    step_id: int  # increments with every `schedule()` call, from 0
    to_prepare: list[str] = field(default_factory=list)  # admitted from WAITING: prepare them
    resumed: list[str] = field(default_factory=list)  # admitted from PREEMPTED: state kept
    batches: list[list[str]] = field(default_factory=list)  # prepared running ids, one per key
    finished: set[str] = field(default_factory=set)  # finished since the last tick, told once
    num_running: int = 0
    num_waiting: int = 0

    @property
    def scheduled_ids(self) -> list[str]:
        return [rid for batch in self.batches for rid in batch]

    @property
    def is_empty(self) -> bool:
        """Nothing to prepare and nothing to step: the engine may block until told more."""
        return not self.to_prepare and not self.batches


def resolve_total_steps(
    timesteps: Sized | None,
    sigmas: Sized | None,
    num_inference_steps: int | None,
) -> int | None:
    """Steps a denoise loop will take: explicit timesteps > explicit sigmas > the step count.

    Empty or None sequences are skipped. Tensors count their first dimension; a 0-dim one is 1.
    """
    for values in (timesteps, sigmas):
        length = _length(values)
        if length:
            return length
    return num_inference_steps


def _length(values: Sized | None) -> int:
    if values is None:
        return 0
    if getattr(values, "shape", None) == ():  # a 0-dim tensor or array holds one value
        return 1
    return len(values)


def validate_budget(request: EngineRequest[object]) -> None:
    """Raise InvalidInputError unless the request's StepBudget can be run."""
    rid, total, start = request.request_id, request.budget.total_steps, request.budget.start_step
    if total is not None and total < 1:
        raise InvalidInputError(
            "num_inference_steps", f"Request {rid} must have positive total steps, got {total}"
        )
    if start < 0 or (total is not None and start >= total):
        bound = "" if total is None else f" and below total steps {total}"
        raise InvalidInputError(
            "step_index",
            f"Request {rid} has invalid initial step_index {start}; it must be >= 0{bound}",
        )


class Scheduler:
    """FIFO by (priority, arrival), at most `max_running` running, batches by batch key.

    It never reads a payload: requests of any input type are EngineRequest[object] here.
    """

    def __init__(self, max_running: int = 1) -> None:
        assert max_running >= 1, f"max_running must be >= 1, got {max_running}"
        self.max_running = max_running
        self._records: dict[str, RequestRecord] = {}
        self._waiting: list[str] = []  # front runs first; preempted requests go to the front
        self._running: list[str] = []  # admission order
        self._finished_since_tick: set[str] = set()
        self._next_step_id = 0
        self._next_arrival = 0

    # -- admission -------------------------------------------------------------------------

    def add_request(self, request: EngineRequest[object]) -> RequestRecord:
        """Queue a new request as WAITING; raises InvalidInputError for a bad budget or id."""
        validate_budget(request)
        rid = request.request_id
        if rid in self._records:
            raise InvalidInputError("request_id", f"Request {rid} is already in the engine")
        record = RequestRecord(
            request=request, arrival=self._next_arrival, step_index=request.budget.start_step
        )
        self._next_arrival += 1
        self._records[rid] = record
        self._insert_waiting(record)
        return record

    def _insert_waiting(self, record: RequestRecord) -> None:
        """After every waiting request of equal or higher priority (lower number)."""
        priority = record.request.priority
        index = len(self._waiting)
        while index > 0 and self._records[self._waiting[index - 1]].request.priority > priority:
            index -= 1
        self._waiting.insert(index, record.request_id)

    # -- planning --------------------------------------------------------------------------

    def schedule(self) -> TickPlan:
        """Admit waiting requests up to `max_running`, then group the steppable running ones.

        A request admitted from WAITING is only listed in `to_prepare`: its batch key is known
        once prepared, so it is stepped from the next tick on.
        """
        plan = TickPlan(step_id=self._next_step_id, finished=self._finished_since_tick)
        self._next_step_id += 1
        self._finished_since_tick = set()
        while self._waiting and len(self._running) < self.max_running:
            record = self._records[self._waiting.pop(0)]
            (plan.resumed if record.prepared else plan.to_prepare).append(record.request_id)
            record.state = RequestState.RUNNING
            if record.first_scheduled_at is None:
                record.first_scheduled_at = time.monotonic()
            self._running.append(record.request_id)
        plan.batches = self._group_batches()
        plan.num_running, plan.num_waiting = len(self._running), len(self._waiting)
        return plan

    def _group_batches(self) -> list[list[str]]:
        groups: dict[Hashable, list[str]] = {}
        for rid in self._running:
            record = self._records[rid]
            if record.prepared and not record.waiting_for_input:
                record.input_since_schedule = False
                groups.setdefault(record.batch_key, []).append(rid)
        return list(groups.values())

    def mark_prepared(self, request_id: str, batch_key: Hashable) -> None:
        """The adapter now holds a state for the request; it is stepped from the next tick."""
        record = self._records[request_id]
        record.prepared = True
        record.batch_key = batch_key

    def mark_input_ready(self, request_id: str) -> None:
        """New input arrived: a request that was waiting for input may be stepped again."""
        record = self._records.get(request_id)
        if record is not None:
            record.waiting_for_input = False
            record.input_since_schedule = True

    # -- outcomes --------------------------------------------------------------------------

    def update_from_output(
        self, plan: TickPlan, outputs: Mapping[str, StepOutput[object]]
    ) -> set[str]:
        """Apply the tick's step outputs; return the ids of `plan` that are now finished.

        A request that was aborted after `schedule()` is returned as finished and its output is
        ignored, so the engine observes the terminal state instead of stepping it again.
        """
        finished: set[str] = set()
        for rid in plan.scheduled_ids:
            record = self._records.get(rid)
            if record is None:
                continue
            if not record.is_finished:
                self._apply_output(record, outputs.get(rid))
            if record.is_finished:
                finished.add(rid)
        return finished

    def _apply_output(self, record: RequestRecord, output: StepOutput[object] | None) -> None:
        if output is None:
            self._finish(record, RequestState.FINISHED_ERROR, error=MISSING_OUTPUT)
        elif output.error is not None:
            self._finish(record, RequestState.FINISHED_ERROR, error=output.error)
        elif output.step_index is None:
            self._finish(record, RequestState.FINISHED_ERROR, error=MISSING_STEP_INDEX)
        else:
            record.step_index = output.step_index
            record.waiting_for_input = output.waiting_for_input and not record.input_since_schedule
            if output.finished:
                self._finish(record, RequestState.FINISHED_COMPLETED)

    def finish_requests(
        self,
        request_ids: str | Collection[str] | None,
        state: RequestState,
        reason: AbortReason | None = None,
        *,
        error: str | None = None,
        error_field: str | None = None,
        signal_at: float | None = None,
    ) -> set[str]:
        """The only abort path. None means every live request (shutdown).

        `reason` (default CANCELLED) and `signal_at` (default now) are kept for aborts;
        `error` and `error_field` for FINISHED_ERROR.

        Waiting requests leave the queue at once, so they are never prepared; running ones are
        marked and leave the running set. Unknown or already finished ids are skipped, so a
        repeated call is harmless. Returns the ids this call finished.
        """
        assert state.is_finished, f"finish_requests needs a finished state, got {state.name}"
        if request_ids is None:
            request_ids = [*self._running, *self._waiting]
        elif isinstance(request_ids, str):
            request_ids = [request_ids]
        finished: set[str] = set()
        for rid in dict.fromkeys(request_ids):
            record = self._records.get(rid)
            if record is None or record.is_finished:
                continue
            self._finish(record, state, error=error, error_field=error_field)
            if state is RequestState.FINISHED_ABORTED:
                record.abort_reason = AbortReason.CANCELLED if reason is None else reason
                record.abort_signal_at = time.monotonic() if signal_at is None else signal_at
            finished.add(rid)
        return finished

    def _finish(
        self,
        record: RequestRecord,
        state: RequestState,
        *,
        error: str | None = None,
        error_field: str | None = None,
    ) -> None:
        rid = record.request_id
        if rid in self._running:
            self._running.remove(rid)
        elif rid in self._waiting:
            self._waiting.remove(rid)
        record.state = state
        if state is RequestState.FINISHED_ERROR:
            record.error, record.error_field = error, error_field
        self._finished_since_tick.add(rid)

    def preempt_request(self, request_id: str) -> bool:
        """Move a running request to the front of the queue, keeping its step and state."""
        record = self._records.get(request_id)
        if record is None or record.state is not RequestState.RUNNING:
            return False
        self._running.remove(request_id)
        self._waiting.insert(0, request_id)
        record.state = RequestState.PREEMPTED
        return True

    # -- queries ---------------------------------------------------------------------------

    def has_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def pop(self, request_id: str) -> RequestRecord | None:
        """Forget a request (normally a finished one); None if it is unknown."""
        record = self._records.pop(request_id, None)
        for queue in (self._running, self._waiting):
            if request_id in queue:
                queue.remove(request_id)
        return record

    def position(self, request_id: str) -> int:
        """How many requests are ahead of a waiting one (0 = next to run)."""
        return self._waiting.index(request_id)

    def expired(self, now: float) -> list[str]:
        """Live requests whose deadline is at or before `now`."""
        return [
            rid
            for rid in [*self._running, *self._waiting]
            if (deadline := self._records[rid].request.deadline) is not None and deadline <= now
        ]

    def next_deadline(self) -> float | None:
        """The earliest deadline among live requests, for the engine's idle wait."""
        deadlines = [
            deadline
            for rid in [*self._running, *self._waiting]
            if (deadline := self._records[rid].request.deadline) is not None
        ]
        return min(deadlines, default=None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)
