"""The scheduler plans each tick of a stage engine; it never calls the model.

The engine calls, on its compute thread only:

- `add_request` when a submit is drained from the control queue;
- `schedule` once per tick, to learn whom to prepare, whom it preempted and which batches to
  step (in order);
- `mark_prepared` after `adapter.prepare`, so the request is stepped from the next tick on;
- `record_step_cost` after each `step` call, with the batch key and the call's wall time;
- `apply_outputs` after each batch's step, once cancels have been drained again;
- `finish_requests` for every abort (cancel, deadline, shutdown) and every engine-side failure;
- `pop` when the engine has released a finished request and published its terminal event.

Capacity. `max_running` requests hold adapter state at once (running + preempted); a new request
is admitted (prepared) only below it. At most `max_batch` of them run; the rest of the holders
are PREEMPTED. Running requests are grouped by batch key; a key that steps in a tick steps every
one of its running requests once, in batches of at most `max_batch`, most urgent first.

Turns: keyed deficit round robin over compute time (vllm-omni's answer for parameter-key
queues). Keys share the stage's time equally, not its ticks. A key that steps in a tick is
charged, as debt, the wall time its step calls took (`record_step_cost`, fed by the engine);
every tick pays one quantum (the cheapest key's last tick of steps) off the debt of every key
with runnable requests, never below zero (no credit is banked); the keys that owe nothing step,
the others wait. So a cheap key (a small image) steps about eight times while a key eight times
dearer steps once, and no key waits for the others' forwards every tick (no head-of-line
blocking). The quantum is never below the dearest key's cost / `MAX_TICKS_WITHOUT_STEP`, so a
key with runnable requests steps at least once in every that many ticks (no starvation); a key
new to the turns (or back after having had nothing to step) steps in its first tick. With one
key, or keys of equal cost, every running request steps every tick. Urgency and turns: urgency
decides who runs (admission, preemption) and the order within a tick (keys by their most urgent
request, requests by theirs); the turns decide only which running keys step in a tick, so
priority buys a request a run slot, not a larger share of time than the other keys that run.

Order. Requests run in order of urgency: lower `priority` first, FIFO among equals, and every
request gains one priority level per `PRIORITY_AGING_SECONDS` since it was submitted, so a
request of any priority eventually runs before every newer one (no starvation). Urgency is
therefore a fixed number per request (`priority * aging + submitted_at`): the order between two
requests never changes while they wait, so nobody is preempted back and forth.

Preemption, at the step boundary (in `schedule`): while a waiting request is more urgent than
the least urgent running one and may run (it already holds state, or there is room for one
more holder), that running request is PREEMPTED: it keeps its state and step index and goes
back into the queue at its own urgency; it resumes (never prepared again) once it is among the
most urgent that may run. With `max_batch == max_running` (the default) nobody is ever
preempted: preempting would need a holder over `max_running`.

Batch forming. Requests sent together reach a stage a few milliseconds apart; admitted as they
come, the first would run a step (or several, behind a previous stage's batch) alone, and the
others would join it one step behind and trail it to the end. With an `admission_window` (0, off,
unless the stage sets one), a stage that holds no request admits nobody until a full batch waits
or no request has arrived for a window (the arrivals of a burst are seldom more than a window
apart even when they are spread over several), but at the latest `MAX_FORMING_WINDOWS` windows
after the first arrival: the whole burst then starts in one batch. A lone request is delayed by
one window; a request arriving while others run is never held (it joins them at the next step
boundary).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sized
from dataclasses import dataclass, field

from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, StepOutput
from stagemesh.shared.engine.request import AbortReason, RequestRecord, RequestState

MISSING_STEP_INDEX = "Missing step_index in step output"
MISSING_OUTPUT = "No output for request"

#: A request gains one priority level (runs as if its `priority` were one lower) per this many
#: seconds since it was submitted: a priority-5 request submitted 50 s ago ranks with a
#: priority-0 request submitted now. Large enough that priorities mean something under load,
#: small enough that a low-priority request waits minutes, not forever.
PRIORITY_AGING_SECONDS = 10.0

#: The starvation bound of the turns: a key with runnable requests steps at least once in every
#: this many ticks, however much dearer its steps are than the others' (up to this cost ratio
#: keys share time equally; beyond it the dear key gets more than its share).
MAX_TICKS_WITHOUT_STEP = 16

#: The admission window of the text-to-image stages (tokenizer, DiT, VAE) unless a recipe sets
#: one (module docstring: "Batch forming"). Measured on a loaded 2-core machine, a burst of 8
#: requests reaches the DiT within 10-20 ms of its first and the tokenizer over 10-80 ms, mostly
#: less than 20 ms apart (the gateway's event loop sends them one by one); a lone request pays
#: 20 ms per stage, small next to its compute (a DiT step alone is 50-150 ms).
BURST_ADMISSION_WINDOW_SECONDS = 0.020

#: A batch being formed is admitted at the latest this many admission windows after its first
#: request arrived, however closely more keep arriving.
MAX_FORMING_WINDOWS = 4

#: Seconds of debt a key may still owe and step: rounding slack far below any step's time.
_DEBT_SLACK_SECONDS = 1e-9


@dataclass
class TickPlan:
    """What one tick does, in order: prepare, then one `step` call per batch."""

    step_id: int  # increments with every `schedule()` call, from 0
    to_prepare: list[str] = field(default_factory=list)  # admitted from WAITING: prepare them
    resumed: list[str] = field(default_factory=list)  # admitted from PREEMPTED: state kept
    preempted: list[str] = field(default_factory=list)  # RUNNING -> PREEMPTED in this schedule
    batches: list[list[str]] = field(default_factory=list)  # one `step` call each, in order
    finished: set[str] = field(default_factory=set)  # finished since the last tick, told once
    num_running: int = 0
    num_waiting: int = 0  # queued for a run slot, preempted ones included

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


@dataclass
class _KeyAccount:
    """One batch key's standing in the turns."""

    debt: float = 0.0  # compute seconds it owes the other keys; it steps when it owes none
    last_cost: float = 0.0  # seconds its step calls took in the last tick it was charged
    charged_tick: int | None = None  # that tick; None until it is first charged


class KeyedDeficitRoundRobin:
    """Which batch keys step in a tick, so that keys share compute time equally.

    Each tick, every key with runnable requests pays off one quantum of its debt (never below
    zero: credit is not banked); the keys that owe nothing step and are then charged what their
    steps took. See the module docstring for the policy and its bounds.
    """

    def __init__(self, max_ticks_without_step: int = MAX_TICKS_WITHOUT_STEP) -> None:
        assert max_ticks_without_step >= 1, f"needs >= 1 tick, got {max_ticks_without_step}"
        self._max_ticks_without_step = max_ticks_without_step
        self._accounts: dict[Hashable, _KeyAccount] = {}
        self._tick = -1

    def pick(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """The keys (of `keys`, those with runnable requests, in that order) that step now.

        Never empty when `keys` is not: the cheapest key's debt is always paid off in a tick.
        A key not in `keys` leaves the turns and forgets its debt (as a DRR queue that empties).
        """
        self._tick += 1
        active = list(keys)
        self._accounts = {key: self._accounts.get(key) or _KeyAccount() for key in active}
        quantum = self._quantum()
        for account in self._accounts.values():
            account.debt = max(account.debt - quantum, 0.0)
        paid = [key for key in active if self._accounts[key].debt <= _DEBT_SLACK_SECONDS]
        if paid or not active:
            return paid
        return [min(active, key=lambda key: self._accounts[key].debt)]  # defensive: never idle

    def charge(self, key: Hashable, seconds: float) -> None:
        """A step call of `key` in the current tick took `seconds`; unknown keys are ignored."""
        account = self._accounts.get(key)
        if account is None:
            return
        if account.charged_tick != self._tick:  # its first step call of this tick
            account.charged_tick, account.last_cost = self._tick, 0.0
        account.last_cost += seconds
        account.debt += seconds

    def _quantum(self) -> float:
        """The cheapest key's last step time, but at least the dearest's / the tick bound."""
        costs = [a.last_cost for a in self._accounts.values() if a.charged_tick is not None]
        if not costs:
            return 0.0
        return max(min(costs), max(costs) / self._max_ticks_without_step)


class Scheduler:
    """Urgency order with aging, `max_running` holders, `max_batch` running, preemption,
    batches by batch key taking cost-aware turns. See the module docstring.

    It never reads a payload: requests of any input type are EngineRequest[object] here.
    `max_batch` None (or above `max_running`) means `max_running`. `clock` is injectable for
    tests; it must be the clock of `EngineRequest.deadline` (time.monotonic).
    `admission_window`: seconds an idle stage waits for a batch to form (module docstring).
    """

    def __init__(
        self,
        max_running: int = 1,
        max_batch: int | None = None,
        *,
        aging_seconds: float = PRIORITY_AGING_SECONDS,
        admission_window: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_running >= 1, f"max_running must be >= 1, got {max_running}"
        assert max_batch is None or max_batch >= 1, f"max_batch must be >= 1, got {max_batch}"
        assert aging_seconds > 0, f"aging_seconds must be > 0, got {aging_seconds}"
        assert admission_window >= 0, f"admission_window must be >= 0, got {admission_window}"
        self.max_running = max_running
        self.max_batch = max_running if max_batch is None else min(max_batch, max_running)
        self._aging_seconds = aging_seconds
        self.admission_window = admission_window
        self._admit_at: float | None = None  # when a batch being formed is admitted anyway
        self._clock = clock
        self._records: dict[str, RequestRecord] = {}
        self._queue: list[str] = []  # WAITING and PREEMPTED, most urgent first
        self._preempted: set[str] = set()  # the PREEMPTED part of the queue (they hold state)
        self._running: list[str] = []  # RUNNING, admission order
        self._turns = KeyedDeficitRoundRobin()  # which batch keys step in a tick
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
            request=request,
            arrival=self._next_arrival,
            step_index=request.budget.start_step,
            submitted_at=self._clock(),
        )
        self._next_arrival += 1
        self._records[rid] = record
        self._enqueue(record)
        return record

    def urgency(self, record: RequestRecord) -> tuple[float, int]:
        """Sort key, lower runs sooner: priority aged by the time since submit, then arrival."""
        aged = record.request.priority * self._aging_seconds + record.submitted_at
        return (aged, record.arrival)

    def _enqueue(self, record: RequestRecord) -> None:
        """Into the queue at the record's urgency (after its equals: FIFO)."""
        bisect.insort(self._queue, record.request_id, key=self._urgency_of)

    def _urgency_of(self, request_id: str) -> tuple[float, int]:
        return self.urgency(self._records[request_id])

    # -- planning --------------------------------------------------------------------------

    def schedule(self) -> TickPlan:
        """Admit and preempt at this step boundary, then plan the tick's batches.

        A request admitted from WAITING is only listed in `to_prepare`: its batch key is known
        once prepared, so it is stepped from the next tick on.
        """
        plan = TickPlan(step_id=self._next_step_id, finished=self._finished_since_tick)
        self._next_step_id += 1
        self._finished_since_tick = set()
        self._fill_free_slots(plan)
        self._preempt_for_more_urgent(plan)
        plan.batches = self._plan_batches()
        plan.num_running, plan.num_waiting = len(self._running), len(self._queue)
        return plan

    def _fill_free_slots(self, plan: TickPlan) -> None:
        """Most urgent first; a request that needs new state is skipped while holders are full
        (a preempted one behind it may still resume: it needs no new state). Nobody is
        admitted while a batch is forming."""
        if self._forming_batch():
            return
        for rid in list(self._queue):
            if len(self._running) >= self.max_batch:
                return
            if self._may_run(rid):
                self._start_running(rid, plan)

    def _forming_batch(self) -> bool:
        """Whether an idle stage still waits for a burst's stragglers (module docstring:
        "Batch forming"); if so, `next_deadline` says when to admit them anyway."""
        self._admit_at = None
        if self.admission_window <= 0 or self.num_holding or not self._queue:
            return False
        if len(self._queue) >= self.max_batch:
            return False
        arrivals = [self._records[rid].submitted_at for rid in self._queue]
        window = self.admission_window
        admit_at = min(max(arrivals) + window, min(arrivals) + MAX_FORMING_WINDOWS * window)
        if self._clock() >= admit_at:
            return False
        self._admit_at = admit_at
        return True

    def _preempt_for_more_urgent(self, plan: TickPlan) -> None:
        while (candidate := self._most_urgent_that_may_run()) is not None:
            victim = self._least_urgent_preemptible()
            if victim is None or self._urgency_of(candidate) >= self._urgency_of(victim):
                return
            self.preempt_request(victim)
            plan.preempted.append(victim)
            self._start_running(candidate, plan)

    def _may_run(self, request_id: str) -> bool:
        """Whether a queued request could run now, were there a run slot for it."""
        return request_id in self._preempted or self.num_holding < self.max_running

    def _most_urgent_that_may_run(self) -> str | None:
        return next((rid for rid in self._queue if self._may_run(rid)), None)

    def _least_urgent_preemptible(self) -> str | None:
        """The least urgent running request that holds state (one admitted in this schedule
        is not prepared yet, and is more urgent than anyone left in the queue)."""
        prepared = [rid for rid in self._running if self._records[rid].prepared]
        return max(prepared, key=self._urgency_of, default=None)

    def _start_running(self, request_id: str, plan: TickPlan) -> None:
        record = self._records[request_id]
        self._queue.remove(request_id)
        if request_id in self._preempted:
            self._preempted.discard(request_id)
            plan.resumed.append(request_id)
        else:
            plan.to_prepare.append(request_id)
        record.state = RequestState.RUNNING
        if record.first_scheduled_at is None:
            record.first_scheduled_at = self._clock()
        self._running.append(request_id)

    def _plan_batches(self) -> list[list[str]]:
        """The steppable running requests of the keys whose turn it is (see the module
        docstring), by key, in batches of at most `max_batch`; keys and requests in order of
        urgency (a key ranks by its most urgent request)."""
        groups: dict[Hashable, list[str]] = {}
        for rid in sorted(self._running, key=self._urgency_of):
            record = self._records[rid]
            if record.prepared and not record.waiting_for_input:
                groups.setdefault(record.batch_key, []).append(rid)
        batches: list[list[str]] = []
        for key in self._turns.pick(groups):
            group = groups[key]
            for rid in group:
                self._records[rid].input_since_schedule = False
            batches.extend(
                group[start : start + self.max_batch]
                for start in range(0, len(group), self.max_batch)
            )
        return batches

    def record_step_cost(self, batch_key: Hashable, seconds: float) -> None:
        """A step call of this tick's batch of `batch_key` took `seconds` of wall time: the key
        is charged it in the turns (every call counts, retries and runs to the end included)."""
        self._turns.charge(batch_key, seconds)

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
        """Apply the outputs of every batch of `plan`; see `apply_outputs`."""
        return self.apply_outputs(plan.scheduled_ids, outputs)

    def apply_outputs(
        self, request_ids: Iterable[str], outputs: Mapping[str, StepOutput[object]]
    ) -> set[str]:
        """Apply the step outputs of `request_ids`; return those of them now finished.

        A stepped request without an output fails (MISSING_OUTPUT). A request that was aborted
        after `schedule()` is returned as finished and its output is ignored, so the engine
        observes the terminal state instead of stepping it again.
        """
        finished: set[str] = set()
        for rid in request_ids:
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

        Waiting requests leave the queue at once, so they are never prepared; running and
        preempted ones are marked and leave the engine's sets. Unknown or already finished ids
        are skipped, so a repeated call is harmless. Returns the ids this call finished.
        """
        assert state.is_finished, f"finish_requests needs a finished state, got {state.name}"
        if request_ids is None:
            request_ids = [*self._running, *self._queue]
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
                record.abort_signal_at = self._clock() if signal_at is None else signal_at
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
        self._forget(record.request_id)
        record.state = state
        if state is RequestState.FINISHED_ERROR:
            record.error, record.error_field = error, error_field
        self._finished_since_tick.add(record.request_id)

    def _forget(self, request_id: str) -> None:
        """Out of the running list and the queue (whichever holds it)."""
        if request_id in self._running:
            self._running.remove(request_id)
        elif request_id in self._queue:
            self._queue.remove(request_id)
            self._preempted.discard(request_id)

    def preempt_request(self, request_id: str) -> bool:
        """RUNNING -> PREEMPTED: back into the queue at its urgency, keeping its step and state.

        Only a prepared running request can be preempted (False otherwise).
        """
        record = self._records.get(request_id)
        if record is None or record.state is not RequestState.RUNNING or not record.prepared:
            return False
        self._running.remove(request_id)
        record.state = RequestState.PREEMPTED
        self._preempted.add(request_id)
        self._enqueue(record)
        return True

    # -- queries ---------------------------------------------------------------------------

    def has_requests(self) -> bool:
        return bool(self._queue or self._running)

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def pop(self, request_id: str) -> RequestRecord | None:
        """Forget a request (normally a finished one); None if it is unknown."""
        record = self._records.get(request_id)
        if record is not None:
            self._forget(request_id)
            del self._records[request_id]
        return record

    def position(self, request_id: str) -> int:
        """How many queued requests are ahead of a queued one (0 = next to run)."""
        return self._queue.index(request_id)

    def expired(self, now: float) -> list[str]:
        """Live requests whose deadline is at or before `now`."""
        return [
            rid
            for rid in [*self._running, *self._queue]
            if (deadline := self._records[rid].request.deadline) is not None and deadline <= now
        ]

    def next_deadline(self) -> float | None:
        """When the engine's idle wait must end: the earliest deadline among live requests, or
        the end of the admission window of a batch being formed, whichever comes first."""
        deadlines = [
            deadline
            for rid in [*self._running, *self._queue]
            if (deadline := self._records[rid].request.deadline) is not None
        ]
        if self._admit_at is not None:
            deadlines.append(self._admit_at)
        return min(deadlines, default=None)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a run slot: waiting ones and preempted ones."""
        return len(self._queue)

    @property
    def num_preempted(self) -> int:
        """Queued requests that hold state (PREEMPTED)."""
        return len(self._preempted)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_holding(self) -> int:
        """Requests that hold adapter state or are about to: running + preempted."""
        return len(self._running) + len(self._preempted)
