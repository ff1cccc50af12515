"""The step engine: one compute thread drives a StageAdapter; asyncio callers get event streams.

One tick of the compute thread, in vLLM's order (see `StepEngine._tick`):

1. drain the control queue (submit, add_input, abort, shutdown); block there when idle;
2. abort requests whose deadline has passed;
3. schedule (admit, preempt: see `scheduler`); tell the preempted; prepare the newly admitted
   (a failing prepare fails that request only);
4. for each batch of the plan (one batch key, at most `max_batch` requests), in order:
   a. drain the control queue, so requests cancelled since the tick began are not stepped;
   b. step the batch (one `adapter.step` call; see `_step` for interrupts and failures) and
      charge its wall time to its batch key, for the scheduler's cost-aware turns;
   c. drain the control queue again, so a cancel that arrived during the step wins over its
      output;
   d. apply the outputs, publish events for the requests still live, and release every
      request that finished (completed, aborted or failed) right there, exactly once.

Mid-step abort: `abort` also tells the engine's StepInterrupt at once, on the caller's thread.
When every request of the step in flight is cancelled, an Interruptible adapter stops the step
part-way (raises StepInterrupted); the engine then releases those requests at once as aborted
(`stagemesh_forward_interrupts_total` counts it). An interrupted step is never a failure.

Failure isolation: a step call of several requests that raises is rerun one request at a time,
so only the request that makes it raise fails. This relies on the adapter contract that a step
which raises has advanced none of its states (see `adapter`).

REQUEST mode runs each batch to its end in step 4b and skips 4c: a running request cannot be
aborted. It calls the same `adapter.step`, so results are identical; it exists for benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeAlias

from stagemesh.shared.engine.adapter import (
    EngineRequest,
    ExecutionMode,
    InputT,
    InvalidInputError,
    PartialT,
    ResultT,
    StageAdapter,
    StateT,
    StepOutput,
    StreamT,
)
from stagemesh.shared.engine.events import (
    Aborted,
    Completed,
    Event,
    Failed,
    Partial,
    Preempted,
    PrepareTiming,
    Progress,
    Queued,
    Terminal,
    is_terminal,
)
from stagemesh.shared.engine.interrupt import Interruptible, StepInterrupt, StepInterrupted
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.engine.request import AbortReason, RequestRecord, RequestState
from stagemesh.shared.engine.scheduler import Scheduler, validate_budget

logger = logging.getLogger(__name__)

#: An abort for an id not (yet) submitted is remembered this long, for at most this many ids,
#: so that a submit arriving after its own cancel is aborted before any compute. A cancel by id
#: from another gateway (shared/control.py) leaves one here when the request has not arrived:
#: these are the mesh's pending cancels, bounded and expiring.
TOMBSTONE_TTL_SECONDS = 60.0
MAX_TOMBSTONES = 10_000

#: Requests in flight (waiting + running) an engine accepts before refusing new ones.
DEFAULT_MAX_PENDING = 256


class QueueFullError(RuntimeError):
    """The engine has `max_pending` requests in flight; becomes RESOURCE_EXHAUSTED."""


class EngineClosed(RuntimeError):
    """The engine admits nothing new: it drains for a shutdown, or its thread has stopped.
    Becomes UNAVAILABLE, so that a gateway retries the request on another replica."""


#: Thread-safe: hands one event to the request's stream.
Sink: TypeAlias = Callable[[Event[PartialT, ResultT]], None]


# Control messages, from any thread to the compute thread.
@dataclass(frozen=True)
class _Submit(Generic[InputT, PartialT, ResultT]):
    request: EngineRequest[InputT]
    sink: Sink[PartialT, ResultT]
    owner: str = ""  # who may cancel it by id (see `submit`)


@dataclass(frozen=True)
class _Input(Generic[StreamT]):
    request_id: str
    payload: StreamT


@dataclass(frozen=True)
class _Abort:
    request_id: str
    reason: AbortReason
    at: float  # time.monotonic() of the abort signal
    #: A cancel by id from a gateway: a pending one (a tombstone) stops only a request of
    #: this owner. None: the stage's own abort (its RPC ended), which stops any.
    owner: str | None = None


@dataclass(frozen=True)
class _Tombstone:
    at: float
    reason: AbortReason
    owner: str | None

    def stops(self, owner: str) -> bool:
        return self.owner is None or self.owner == owner


@dataclass(frozen=True)
class _Shutdown:
    abort_running: bool


#: Type parameters in order of first appearance: InputT, PartialT, ResultT, StreamT.
_Message: TypeAlias = _Submit[InputT, PartialT, ResultT] | _Input[StreamT] | _Abort | _Shutdown


@dataclass
class _Slot(Generic[InputT, StreamT, StateT, PartialT, ResultT]):
    """The compute thread's side of one admitted request."""

    request: EngineRequest[InputT]
    sink: Sink[PartialT, ResultT]
    state: StateT | None = None  # the adapter's state, once prepared
    pending_inputs: list[StreamT] = field(default_factory=list)  # arrived before prepare
    step_seconds: float = 0.0  # duration of the last step call it took part in
    prepare_timing: PrepareTiming | None = None  # its prepare, told with every progress
    owner: str = ""  # who may cancel it by id (see StepEngine.submit)

    @property
    def prepared(self) -> bool:
        return self.state is not None

    def prepared_state(self) -> StateT:
        assert self.state is not None, f"{self.request.request_id} is not prepared"
        return self.state


class RequestStream(Generic[PartialT, ResultT]):
    """The events of one request, as an async iterator that ends after the terminal event."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[Event[PartialT, ResultT]] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> RequestStream[PartialT, ResultT]:
        return self

    async def __anext__(self) -> Event[PartialT, ResultT]:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._done = is_terminal(event)
        return event

    def put(self, event: Event[PartialT, ResultT]) -> None:
        """Event-loop thread only."""
        self._queue.put_nowait(event)


class StepEngine(Generic[InputT, StreamT, StateT, PartialT, ResultT]):
    """Runs one StageAdapter on a compute thread. See the module docstring for the tick.

    Its type parameters are the adapter's (see `stagemesh.shared.engine.adapter`); they are
    inferred from the adapter it is built with.

    max_running: requests that hold adapter state at once (running + preempted); a new request
      is prepared only below it.
    max_batch: requests that run at once, and so the most states one `step` call gets; None
      (or a value above max_running) means max_running, and then nobody is ever preempted.
    max_pending: requests in flight (queued + holding state) before submit refuses more.
    admission_window: seconds an idle engine waits for requests sent together to arrive, so
      they start in one batch (see `scheduler`, "Batch forming"); 0 admits each at once.
    """

    def __init__(
        self,
        adapter: StageAdapter[InputT, StreamT, StateT, PartialT, ResultT],
        *,
        mode: ExecutionMode = ExecutionMode.STEP,
        max_running: int = 1,
        max_batch: int | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        metrics: EngineMetrics | None = None,
        admission_window: float = 0.0,
    ) -> None:
        self._adapter = adapter
        # The one channel from abort() into a step in flight; bound once to an adapter that
        # can stop part-way.
        self._interrupt = StepInterrupt()
        if isinstance(adapter, Interruptible):
            adapter.bind_interrupt(self._interrupt)
        self._mode = mode
        self._max_pending = max_pending
        self._metrics = EngineMetrics(adapter.stage) if metrics is None else metrics
        self._control: queue.SimpleQueue[_Message[InputT, PartialT, ResultT, StreamT]] = (
            queue.SimpleQueue()
        )
        self._closing = False  # set by shutdown(): submit refuses new work
        self._thread = threading.Thread(
            target=self._run, name=f"stagemesh-engine-{adapter.stage}", daemon=True
        )
        # Event-loop side only.
        self._streams: dict[str, RequestStream[PartialT, ResultT]] = {}
        self._owners: dict[str, str] = {}  # request id -> owner, for the live ones
        self._waiters: dict[str, list[asyncio.Future[Terminal[ResultT]]]] = {}
        # Compute thread only.
        self._scheduler = Scheduler(max_running, max_batch, admission_window=admission_window)
        self._slots: dict[str, _Slot[InputT, StreamT, StateT, PartialT, ResultT]] = {}
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()
        self._stopping = False

    # -- asyncio side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(
        self, request: EngineRequest[InputT], owner: str = ""
    ) -> RequestStream[PartialT, ResultT]:
        """Validate at once (raises InvalidInputError) and queue the request; call on a loop.

        `owner` is who may cancel it by id from another gateway (the API key's id; "" when
        keys are off): see `live_ids` and `abort(owner=...)`. Raises EngineClosed while the
        engine drains or after its thread stopped, QueueFullError at `max_pending`.
        """
        rid = request.request_id
        if self._closing:
            state = "has stopped" if self.stopped else "is shutting down"
            raise EngineClosed(f"{self._adapter.stage} engine {state}; refused {rid}")
        if rid in self._streams:
            raise InvalidInputError("request_id", f"Request {rid} is already in flight")
        if len(self._streams) >= self._max_pending:
            raise QueueFullError(f"{self._adapter.stage} stage has {len(self._streams)} requests "
                                 f"in flight (limit {self._max_pending}); retry later")
        self._adapter.check_inputs(request.payload)
        validate_budget(request)
        stream = self._streams[rid] = RequestStream[PartialT, ResultT](rid)
        self._owners[rid] = owner
        self._control.put(
            _Submit(request, self._sink_for(asyncio.get_running_loop(), stream), owner))
        return stream

    def add_input(self, request_id: str, payload: StreamT) -> None:
        """Streamed input for a submitted request; ignored for unknown or finished ids."""
        self._control.put(_Input(request_id, payload))

    def abort(
        self, request_id: str, reason: AbortReason = AbortReason.CANCELLED,
        owner: str | None = None,
    ) -> None:
        """Thread-safe, fire-and-forget. Wins even when it arrives before the submit (then
        only over a request of `owner`, when one is given).

        A step in flight whose every request is now cancelled stops part-way, if the adapter
        can (Interruptible); otherwise the request leaves at the next step boundary.
        """
        self._control.put(_Abort(request_id, reason, time.monotonic(), owner))
        # After the message: a step stopped by this cancel finds the abort queued.
        self._interrupt.cancel(request_id)

    def shutdown(self, abort_running: bool = True, timeout: float | None = 5.0) -> bool:
        """Refuse new work, abort in-flight work (or let it finish), wait for the thread.

        Returns True once the compute thread has exited. It blocks up to `timeout`; from a busy
        event loop, prefer `await asyncio.to_thread(engine.shutdown, ...)`.
        """
        self._closing = True
        self._control.put(_Shutdown(abort_running))
        if abort_running:  # after the message, as in abort()
            self._interrupt.cancel_all()
        if self._thread.ident is None:  # never started
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def max_pending(self) -> int:
        """Requests in flight (waiting + running) before submit raises QueueFullError."""
        return self._max_pending

    @property
    def max_running(self) -> int:
        """Requests that hold adapter state at once (running + preempted)."""
        return self._scheduler.max_running

    @property
    def max_batch(self) -> int:
        """Requests that run at once: the most states one `step` call gets."""
        return self._scheduler.max_batch

    @property
    def num_waiting(self) -> int:
        """Requests queued for a run slot (preempted ones included)."""
        return self._scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self._scheduler.num_running

    @property
    def num_preempted(self) -> int:
        return self._scheduler.num_preempted

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        """The compute thread ran and has exited (shut down, or crashed)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    @property
    def closing(self) -> bool:
        """Submit refuses new work (draining, stopped)."""
        return self._closing

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended (event-loop side)."""
        return len(self._streams)

    def live_ids(self, request_id: str, owner: str) -> list[str]:
        """The live requests `request_id` names for `owner`: itself, and the parts of a
        request of several images (`<id>.<index>`). Event-loop side."""
        prefix = f"{request_id}."
        return [rid for rid in self._streams
                if (rid == request_id or (rid.startswith(prefix)
                                          and rid[len(prefix):].isdigit()))
                and self._owners.get(rid) == owner]

    def finished(self, request_id: str) -> Awaitable[Terminal[ResultT]] | None:
        """A future of a live request's terminal event; None if it is not live. Event-loop
        side; the waiter is registered before this returns, so an abort sent next is seen."""
        if request_id not in self._streams:
            return None
        waiter: asyncio.Future[Terminal[ResultT]] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(request_id, []).append(waiter)
        return waiter

    def _sink_for(
        self, loop: asyncio.AbstractEventLoop, stream: RequestStream[PartialT, ResultT]
    ) -> Sink[PartialT, ResultT]:
        def sink(event: Event[PartialT, ResultT]) -> None:
            try:
                loop.call_soon_threadsafe(self._deliver, stream, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                logger.debug("dropped %s for %s", type(event).__name__, stream.request_id)

        return sink

    def _deliver(
        self, stream: RequestStream[PartialT, ResultT], event: Event[PartialT, ResultT]
    ) -> None:
        stream.put(event)
        if (isinstance(event, Completed | Aborted | Failed)
                and self._streams.get(stream.request_id) is stream):
            del self._streams[stream.request_id]
            self._owners.pop(stream.request_id, None)
            for waiter in self._waiters.pop(stream.request_id, []):
                if not waiter.done():
                    waiter.set_result(event)

    # -- compute thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            idle = False
            while not (self._stopping and not self._scheduler.has_requests()):
                idle = self._tick(idle)
        except Exception:
            logger.exception("%s engine loop crashed; failing live requests", self._adapter.stage)
            self._stopping = True
            self._retire(
                self._scheduler.finish_requests(
                    None, RequestState.FINISHED_ERROR, error="The engine stopped unexpectedly"
                )
            )
        finally:
            self._closing = True
            self._drain_control(block=False)  # submits that raced the shutdown are aborted

    def _tick(self, idle: bool) -> bool:
        """One pass of the loop; returns True when it had nothing to prepare or step."""
        self._drain_control(block=idle)
        self._expire_deadlines()
        plan = self._scheduler.schedule()
        self._announce_preempted(plan.preempted)
        self._prepare(plan.to_prepare)
        for batch in plan.batches:
            self._run_batch(batch)
        self._metrics.observe_queues(
            self._scheduler.num_waiting, self._scheduler.num_running, self._scheduler.num_preempted
        )
        return plan.is_empty

    def _run_batch(self, batch: list[str]) -> None:
        """Step 4 of the tick for one batch: step it, apply its outputs, retire the finished."""
        self._drain_control(block=False)  # requests cancelled since the tick began leave now
        live = [rid for rid in batch if self._is_running(rid)]
        if not live:
            return
        if self._mode_of(live) is ExecutionMode.STEP:
            outputs = self._step(live, interruptible=True)
            self._drain_control(block=False)  # cancels during the step win over its outputs
        else:
            outputs = self._run_to_end(live)
        finished = self._scheduler.apply_outputs(outputs.keys(), outputs)
        self._publish_steps(outputs)
        self._retire(finished)

    def _drain_control(self, block: bool) -> None:
        """Handle every queued message; when `block`, first wait for one (or the next deadline)."""
        try:
            if block:
                message = self._control.get(timeout=self._idle_timeout())
            else:
                message = self._control.get_nowait()
            while True:
                self._handle(message)
                message = self._control.get_nowait()
        except queue.Empty:
            return

    def _idle_timeout(self) -> float | None:
        deadline = self._scheduler.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _handle(self, message: _Message[InputT, PartialT, ResultT, StreamT]) -> None:
        match message:
            case _Submit(request, sink, owner):
                self._admit(request, sink, owner)
            case _Input(request_id, payload):
                self._add_input(request_id, payload)
            case _Abort(request_id, reason, at, owner):
                self._abort(request_id, reason, at, owner)
            case _Shutdown(abort_running):
                self._stopping = True
                if abort_running:
                    self._abort_all(AbortReason.SHUTDOWN)

    def _admit(
        self, request: EngineRequest[InputT], sink: Sink[PartialT, ResultT], owner: str
    ) -> None:
        rid = request.request_id
        tombstone = self._take_tombstone(rid, owner)
        if tombstone is None and self._stopping:
            tombstone = _Tombstone(time.monotonic(), AbortReason.SHUTDOWN, None)
        if tombstone is not None:  # never admitted, never prepared
            self._emit(sink, Aborted(request.budget.start_step, tombstone.reason,
                                     time.monotonic() - tombstone.at))
            return
        try:
            self._scheduler.add_request(request)
        except InvalidInputError as exc:
            self._emit(sink, Failed(str(exc), exc.field_name))
            return
        self._slots[rid] = _Slot(request, sink, owner=owner)
        sink(Queued(self._scheduler.position(rid)))

    def _add_input(self, request_id: str, payload: StreamT) -> None:
        slot = self._slots.get(request_id)
        if slot is None:
            logger.debug("input for unknown or finished request %s ignored", request_id)
        elif not slot.prepared:
            slot.pending_inputs.append(payload)
        else:
            try:
                self._adapter.add_input(slot.prepared_state(), payload)
            except Exception as exc:
                self._fail(request_id, exc)
                return
            self._scheduler.mark_input_ready(request_id)

    def _abort(self, request_id: str, reason: AbortReason, at: float, owner: str | None) -> None:
        slot = self._slots.get(request_id)
        if slot is None:  # not submitted yet (or already gone)
            self._remember_tombstone(request_id, _Tombstone(at, reason, owner))
            return
        if owner is not None and owner != slot.owner:  # another owner's request of that id
            return
        finished = self._scheduler.finish_requests(
            request_id, RequestState.FINISHED_ABORTED, reason, signal_at=at
        )
        self._retire(finished)

    def _abort_all(self, reason: AbortReason) -> None:
        self._retire(self._scheduler.finish_requests(None, RequestState.FINISHED_ABORTED, reason))

    def _expire_deadlines(self) -> None:
        for rid in self._scheduler.expired(time.monotonic()):
            finished = self._scheduler.finish_requests(
                rid,
                RequestState.FINISHED_ABORTED,
                AbortReason.DEADLINE_EXCEEDED,
                signal_at=self._slots[rid].request.deadline,
            )
            self._retire(finished)

    def _remember_tombstone(self, request_id: str, tombstone: _Tombstone) -> None:
        expired_before = time.monotonic() - TOMBSTONE_TTL_SECONDS
        while self._tombstones and (
            len(self._tombstones) >= MAX_TOMBSTONES
            or next(iter(self._tombstones.values())).at < expired_before
        ):
            self._tombstones.popitem(last=False)
        self._tombstones.pop(request_id, None)  # re-inserted last: the newest expires last
        self._tombstones[request_id] = tombstone

    def _take_tombstone(self, request_id: str, owner: str) -> _Tombstone | None:
        """The pending abort for a request arriving now, if one applies to it (a tombstone
        for another owner stays: it is not this request's)."""
        tombstone = self._tombstones.get(request_id)
        if tombstone is None or not tombstone.stops(owner):
            return None
        del self._tombstones[request_id]
        return None if tombstone.at < time.monotonic() - TOMBSTONE_TTL_SECONDS else tombstone

    def _prepare(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            slot, record = self._slots[rid], self._record(rid)
            started = time.monotonic()
            self._metrics.observe_queue_time(started - record.submitted_at)
            try:
                state = slot.state = self._adapter.prepare(slot.request)
                slot.prepare_timing = PrepareTiming(started, time.monotonic())
                self._scheduler.mark_prepared(rid, self._adapter.batch_key(state))
                for payload in slot.pending_inputs:
                    self._adapter.add_input(state, payload)
                slot.pending_inputs.clear()
            except Exception as exc:
                self._fail(rid, exc)

    def _fail(self, request_id: str, exc: Exception) -> None:
        """An adapter call raised for this request only: it fails, the engine keeps serving."""
        field_name = exc.field_name if isinstance(exc, InvalidInputError) else None
        if field_name is None:
            logger.error("%s request %s failed", self._adapter.stage, request_id, exc_info=exc)
        finished = self._scheduler.finish_requests(
            request_id, RequestState.FINISHED_ERROR, error=_describe(exc), error_field=field_name
        )
        self._retire(finished)

    def _is_running(self, request_id: str) -> bool:
        record = self._scheduler.get(request_id)
        return record is not None and record.state is RequestState.RUNNING

    def _announce_preempted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._metrics.observe_preemption()
            self._slots[rid].sink(Preempted(self._record(rid).step_index))

    def _mode_of(self, batch: list[str]) -> ExecutionMode:
        """A batch runs to its end if the engine or any of its requests asks for REQUEST mode."""
        for rid in batch:
            record = self._scheduler.get(rid)
            if record is not None and (record.request.mode or self._mode) is ExecutionMode.REQUEST:
                return ExecutionMode.REQUEST
        return ExecutionMode.STEP

    def _step(
        self, request_ids: list[str], *, interruptible: bool
    ) -> dict[str, StepOutput[PartialT]]:
        """One `adapter.step` call; returns an output for every request it stepped.

        - StepInterrupted (only when `interruptible`): every request of the batch was
          cancelled; they are released now as aborted and get no output.
        - Any other exception: a batch of one fails with it; a larger batch is stepped again
          one request at a time, so only the culprit fails and the others get the output they
          would have had alone (a step that raised advanced none of its states: see adapter).
        - A result of the wrong length fails the whole batch: the states did advance, so
          stepping them again would apply the step twice.
        """
        started = time.monotonic()
        try:
            results = self._call_step(request_ids, interruptible)
        except StepInterrupted:
            self._on_interrupted(request_ids)
            return {}
        except Exception as exc:
            self._observe_step(request_ids, started)
            if len(request_ids) > 1:
                return self._step_one_by_one(request_ids, exc, interruptible)
            logger.error("%s step failed for %s", self._adapter.stage, request_ids[0],
                         exc_info=exc)
            return {request_ids[0]: _error_output(exc)}
        self._observe_step(request_ids, started)
        if len(results) != len(request_ids):
            error = RuntimeError(f"step returned {len(results)} outputs for "
                                 f"{len(request_ids)} states")
            logger.error("%s step failed for %s: %s", self._adapter.stage, request_ids, error)
            return dict.fromkeys(request_ids, _error_output(error))
        return dict(zip(request_ids, results, strict=True))

    def _call_step(
        self, request_ids: list[str], interruptible: bool
    ) -> Sequence[StepOutput[PartialT]]:
        """`adapter.step`, armed for a mid-step abort when `interruptible`."""
        states = [self._slots[rid].prepared_state() for rid in request_ids]
        if interruptible:
            self._interrupt.arm(request_ids)
        try:
            return self._adapter.step(states)
        finally:
            self._interrupt.disarm()

    def _observe_step(self, request_ids: list[str], started: float) -> None:
        """Metrics, each request's step time, and the batch key's charge in the turns."""
        seconds = time.monotonic() - started
        self._metrics.observe_step(seconds, len(request_ids))
        self._scheduler.record_step_cost(self._record(request_ids[0]).batch_key, seconds)
        for rid in request_ids:
            self._slots[rid].step_seconds = seconds

    def _step_one_by_one(
        self, request_ids: list[str], exc: Exception, interruptible: bool
    ) -> dict[str, StepOutput[PartialT]]:
        """Failure isolation: the batched step raised; step each request alone."""
        self._metrics.observe_isolated_step_failure()
        logger.warning("%s step of %d requests failed (%s); stepping each alone",
                       self._adapter.stage, len(request_ids), _describe(exc))
        outputs: dict[str, StepOutput[PartialT]] = {}
        for rid in request_ids:
            if self._is_running(rid):  # an interrupted retry drains aborts of later ones
                outputs.update(self._step([rid], interruptible=interruptible))
        return outputs

    def _on_interrupted(self, request_ids: list[str]) -> None:
        """A step stopped part-way: its requests' aborts are queued already (abort() queues
        before it cancels), so drain them now; they are released in this call."""
        self._metrics.observe_forward_interrupt()
        self._drain_control(block=False)
        left = [rid for rid in request_ids if self._is_running(rid)]
        if left:  # the adapter stopped without being asked: they step again next tick
            logger.warning("%s step stopped part-way but %s were not cancelled",
                           self._adapter.stage, left)

    def _run_to_end(self, request_ids: list[str]) -> dict[str, StepOutput[PartialT]]:
        """REQUEST mode: step until each request stops, publishing progress, seeing no aborts."""
        outputs: dict[str, StepOutput[PartialT]] = {}
        live = request_ids
        while live:
            step_outputs = self._step(live, interruptible=False)
            outputs.update(step_outputs)
            live = [rid for rid in live if rid in step_outputs and _steps_on(step_outputs[rid])]
            self._publish_steps({rid: step_outputs[rid] for rid in live})
        return outputs

    def _publish_steps(self, outputs: Mapping[str, StepOutput[PartialT]]) -> None:
        """Progress (and any partial output) for each request still running or just completed."""
        now = time.monotonic()
        for rid, output in outputs.items():
            record = self._scheduler.get(rid)
            if record is None or output.step_index is None or record.state in _NOT_PUBLISHED:
                continue
            slot = self._slots[rid]
            total = record.request.budget.total_steps
            elapsed = now - record.submitted_at
            slot.sink(Progress(output.step_index, total, slot.step_seconds, elapsed,
                               prepared=slot.prepare_timing, reused=output.reused))
            if output.partial is not None:
                slot.sink(Partial(output.partial))

    def _retire(self, request_ids: Iterable[str]) -> None:
        """Finish, release and tell each finished request once; repeated ids are skipped."""
        for rid in request_ids:
            record, slot = self._scheduler.pop(rid), self._slots.pop(rid, None)
            if record is None or slot is None:
                continue
            completed = self._collect(record, slot)
            if slot.state is not None:
                self._release(rid, slot.state)
            self._emit(slot.sink, completed or self._end_event(record))

    def _collect(
        self, record: RequestRecord, slot: _Slot[InputT, StreamT, StateT, PartialT, ResultT]
    ) -> Completed[ResultT] | Failed | None:
        if record.state is not RequestState.FINISHED_COMPLETED:
            return None
        try:
            return Completed(self._adapter.finish(slot.prepared_state()), record.step_index)
        except Exception as exc:
            logger.exception("%s finish failed for %s", self._adapter.stage, record.request_id)
            return Failed(_describe(exc))

    def _release(self, request_id: str, state: StateT) -> None:
        try:
            self._adapter.release(state)
        except Exception:
            logger.exception("%s release failed for %s", self._adapter.stage, request_id)

    @staticmethod
    def _end_event(record: RequestRecord) -> Aborted | Failed:
        """Aborted or Failed; call after release, since abort latency runs up to the release."""
        if record.state is RequestState.FINISHED_ERROR:
            return Failed(record.error or "Request failed", record.error_field)
        reason = record.abort_reason or AbortReason.CANCELLED
        now = time.monotonic()
        signal_at = now if record.abort_signal_at is None else record.abort_signal_at
        return Aborted(record.step_index, reason, now - signal_at)

    def _emit(self, sink: Sink[PartialT, ResultT], event: Terminal[ResultT]) -> None:
        self._metrics.observe_terminal(event)
        sink(event)

    def _record(self, request_id: str) -> RequestRecord:
        record = self._scheduler.get(request_id)
        assert record is not None, f"no record for live request {request_id}"
        return record


_NOT_PUBLISHED = (RequestState.FINISHED_ABORTED, RequestState.FINISHED_ERROR)


def _steps_on(output: StepOutput[object]) -> bool:
    """Whether a request-mode run keeps stepping this request after `output`."""
    return (
        output.error is None
        and output.step_index is not None
        and not output.finished
        and not output.waiting_for_input
    )


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _error_output(exc: BaseException) -> StepOutput[PartialT]:
    return StepOutput(step_index=None, finished=True, error=_describe(exc))
