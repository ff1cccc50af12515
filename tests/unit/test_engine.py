"""StepEngine on its real compute thread, driven through a fake adapter whose steps the test
can hold open, so cancels land exactly where each test wants them. No model, no gRPC."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import pytest
from prometheus_client import CollectorRegistry

from stagemesh.shared.engine.adapter import (
    EngineRequest,
    ExecutionMode,
    InvalidInputError,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.engine import QueueFullError, RequestStream, StepEngine
from stagemesh.shared.engine.events import (
    Aborted,
    Completed,
    Event,
    Failed,
    Partial,
    Preempted,
    Progress,
    Queued,
)
from stagemesh.shared.engine.interrupt import StepInterrupt, StepInterrupted
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.engine.request import AbortReason

pytestmark = pytest.mark.timeout(10)

WAIT = 3.0  # seconds any single wait may take before the test fails instead of hanging
BLOCK_SECONDS = 0.005  # a held step polls its gate (and an interrupt) this often


@dataclass(frozen=True)
class FakeInput:
    prompt: str = "a prompt"  # "" is refused by check_inputs
    key: str = "k"  # the batch key
    streamed: bool = False  # consumes one add_input per step; None ends the input


#: Streamed input: a frame (its partial output is the frame doubled), or None for "no more".
FakeFrame = int | None
#: (request id, steps done, every partial produced).
FakeResult = tuple[str, int, tuple[int, ...]]
FakeEngine = StepEngine[FakeInput, FakeFrame, "FakeState", int, FakeResult]
FakeStream = RequestStream[int, FakeResult]


@dataclass
class FakeState:
    request_id: str
    total: int | None
    step: int
    key: str
    streamed: bool
    inputs: list[FakeFrame] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)


class FakeAdapter:
    """A StageAdapter that records every call. Gated: each step waits for a permit.

    `open_after(moment)` also holds every step until time.monotonic() has passed `moment`.
    Its step is all-or-nothing, as the adapter contract asks: it raises before advancing any
    state. `most_held` is the most states it held at once (prepared, not yet released).
    """

    stage = "fake"

    def __init__(self, *, gated: bool = False) -> None:
        self.prepared: list[str] = []
        self.released: list[str] = []
        self.most_held = 0
        self.short_results = False  # a buggy step: one output, whatever the batch
        self.finished: list[str] = []
        self.step_calls: list[list[str]] = []
        self.step_entered = threading.Semaphore(0)
        self.fail: dict[str, tuple[str, Exception]] = {}  # request id -> (phase, exception)
        self._gate = threading.Condition()
        self._permits = 0
        self._open = not gated
        self._not_before = 0.0

    def allow(self, steps: int = 1) -> None:
        with self._gate:
            self._permits += steps
            self._gate.notify_all()

    def open(self) -> None:
        with self._gate:
            self._open = True
            self._gate.notify_all()

    def open_after(self, moment: float) -> None:
        """Open the gate, but let no step end before `moment` (a time.monotonic() value)."""
        with self._gate:
            self._not_before = moment
            self._open = True
            self._gate.notify_all()

    def check_inputs(self, payload: FakeInput) -> None:
        if payload.prompt == "":
            raise InvalidInputError("prompt", "prompt must not be empty")

    def prepare(self, request: EngineRequest[FakeInput]) -> FakeState:
        self._maybe_fail("prepare", request.request_id)
        self.prepared.append(request.request_id)
        self.most_held = max(self.most_held, len(self.prepared) - len(self.released))
        return FakeState(
            request_id=request.request_id,
            total=request.budget.total_steps,
            step=request.budget.start_step,
            key=request.payload.key,
            streamed=request.payload.streamed,
        )

    def add_input(self, state: FakeState, payload: FakeFrame) -> None:
        state.inputs.append(payload)

    def step(self, states: Sequence[FakeState]) -> list[StepOutput[int]]:
        self.step_calls.append([s.request_id for s in states])
        self.step_entered.release()
        with self._gate:
            gave_up = time.monotonic() + WAIT
            while not (self._open or self._permits > 0):
                self.between_blocks()
                assert time.monotonic() < gave_up, "the gate never opened"
                self._gate.wait(BLOCK_SECONDS)
            self._permits -= not self._open
            deadline = time.monotonic() + WAIT
            while (left := self._not_before - time.monotonic()) > 0:
                assert time.monotonic() < deadline, "open_after moment never came"
                self._gate.wait(left)
        for state in states:
            self._maybe_fail("step", state.request_id)
        outputs = [self._advance(s) for s in states]
        return outputs[:1] if self.short_results else outputs

    def between_blocks(self) -> None:
        """Where a model would run its next block while the step is held open."""

    def _advance(self, state: FakeState) -> StepOutput[int]:
        if not state.streamed:
            state.step += 1
            done = state.total is not None and state.step >= state.total
            return StepOutput(step_index=state.step, finished=done)
        if not state.inputs:
            return StepOutput(step_index=state.step, waiting_for_input=True)
        frame = state.inputs.pop(0)
        if frame is None:
            return StepOutput(step_index=state.step, finished=True)
        state.step += 1
        state.produced.append(frame * 2)
        return StepOutput(state.step, partial=frame * 2, waiting_for_input=not state.inputs)

    def finish(self, state: FakeState) -> FakeResult:
        self.finished.append(state.request_id)
        return (state.request_id, state.step, tuple(state.produced))

    def release(self, state: FakeState) -> None:
        self.released.append(state.request_id)

    def batch_key(self, state: FakeState) -> str:
        return state.key

    def _maybe_fail(self, phase: str, request_id: str) -> None:
        failing = self.fail.get(request_id)
        if failing is not None and failing[0] == phase:
            raise failing[1]

    def assert_released_once(self) -> None:
        assert set(Counter(self.released).values()) <= {1}
        assert sorted(self.released) == sorted(self.prepared)


class InterruptibleAdapter(FakeAdapter):
    """A FakeAdapter whose held step stops between blocks once the engine's interrupt asks."""

    def __init__(self, *, gated: bool = False) -> None:
        super().__init__(gated=gated)
        self.interrupt: StepInterrupt | None = None
        self.interrupted = 0  # steps stopped part-way

    def bind_interrupt(self, interrupt: StepInterrupt) -> None:
        assert self.interrupt is None, "bound twice"
        self.interrupt = interrupt

    def between_blocks(self) -> None:
        assert self.interrupt is not None, "never bound"
        try:
            self.interrupt.check()
        except StepInterrupted:
            self.interrupted += 1
            raise


def make_request(
    rid: str,
    total_steps: int | None = 3,
    *,
    deadline: float | None = None,
    mode: ExecutionMode | None = None,
    prompt: str = "a prompt",
    key: str = "k",
    streamed: bool = False,
    priority: int = 0,
) -> EngineRequest[FakeInput]:
    return EngineRequest(
        request_id=rid,
        payload=FakeInput(prompt, key, streamed),
        budget=StepBudget(total_steps=total_steps),
        deadline=deadline,
        priority=priority,
        mode=mode,
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


class EngineFactory(Protocol):
    def __call__(
        self,
        adapter: FakeAdapter,
        *,
        mode: ExecutionMode = ...,
        max_running: int = ...,
        max_batch: int | None = ...,
        max_pending: int = ...,
    ) -> FakeEngine: ...


@pytest.fixture
def make_engine(registry: CollectorRegistry) -> Iterator[EngineFactory]:
    created: list[tuple[FakeEngine, FakeAdapter]] = []

    def make(
        adapter: FakeAdapter,
        *,
        mode: ExecutionMode = ExecutionMode.STEP,
        max_running: int = 1,
        max_batch: int | None = None,
        max_pending: int = 256,
    ) -> FakeEngine:
        engine = StepEngine(
            adapter,
            mode=mode,
            max_running=max_running,
            max_batch=max_batch,
            max_pending=max_pending,
            metrics=EngineMetrics("fake", registry),
        )
        created.append((engine, adapter))
        return engine

    yield make
    for engine, adapter in created:
        adapter.open()
        assert engine.shutdown(abort_running=True, timeout=WAIT)
        assert not engine.is_alive


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"stage": "fake", **labels})
    return 0.0 if value is None else value


FakeEvent = Event[int, FakeResult]


async def collect(stream: FakeStream) -> list[FakeEvent]:
    async def drain() -> list[FakeEvent]:
        return [event async for event in stream]

    return await asyncio.wait_for(drain(), WAIT)


async def next_event(stream: FakeStream) -> FakeEvent:
    return await asyncio.wait_for(anext(stream), WAIT)


async def entered_step(adapter: FakeAdapter) -> None:
    assert await asyncio.to_thread(adapter.step_entered.acquire, True, WAIT)


def kinds(events: list[FakeEvent]) -> list[type]:
    return [type(event) for event in events]


def as_aborted(event: FakeEvent) -> Aborted:
    assert isinstance(event, Aborted), event
    return event


async def test_events_are_queued_then_progress_then_completed(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    engine.start()
    submitted = time.monotonic()
    events = await collect(engine.submit(make_request("a", total_steps=3)))
    waited = time.monotonic() - submitted

    assert kinds(events) == [Queued, Progress, Progress, Progress, Completed]
    assert events[0] == Queued(position=0)
    progress = [e for e in events if isinstance(e, Progress)]
    assert [(p.step_index, p.total_steps) for p in progress] == [(1, 3), (2, 3), (3, 3)]
    # Each step really ran, and took part of the time since submit; elapsed keeps growing.
    assert all(0 < p.step_seconds <= p.elapsed_seconds <= waited for p in progress)
    assert progress[0].elapsed_seconds < progress[1].elapsed_seconds < progress[2].elapsed_seconds
    assert events[-1] == Completed(result=("a", 3, ()), step_index=3)
    adapter.assert_released_once()
    assert sample(registry, "stagemesh_steps_total") == 3
    assert sample(registry, "stagemesh_requests_finished_total", status="completed") == 1
    assert sample(registry, "stagemesh_queue_seconds_count") == 1


async def test_queued_abort_is_never_prepared(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter, max_running=1)
    first, second = engine.submit(make_request("a", 2)), engine.submit(make_request("b", 2))
    engine.start()
    assert await next_event(first) == Queued(position=0)
    assert await next_event(second) == Queued(position=1)
    await entered_step(adapter)  # a holds the only running slot; b waits

    engine.abort("b")
    adapter.open()
    assert isinstance((await collect(first))[-1], Completed)
    rest = await collect(second)
    assert len(rest) == 1 and isinstance(rest[0], Aborted)
    assert (rest[0].step_index, rest[0].reason) == (0, AbortReason.CANCELLED)
    assert adapter.prepared == ["a"]
    adapter.assert_released_once()


async def test_running_request_stops_at_the_next_step_boundary(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter)
    engine.start()
    stream = engine.submit(make_request("a", total_steps=5))
    adapter.allow(1)
    await entered_step(adapter)
    await entered_step(adapter)  # step 2 is in flight when the cancel arrives

    signalled = time.monotonic()
    engine.abort("a")
    engine.abort("a")  # repeated: harmless
    adapter.open()
    events = await collect(stream)
    observed = time.monotonic() - signalled
    assert kinds(events) == [Queued, Progress, Aborted]
    aborted = as_aborted(events[-1])
    assert (aborted.step_index, aborted.reason) == (1, AbortReason.CANCELLED)
    # The latency runs from the first abort to the release, after the in-flight step ended.
    assert 0 < aborted.abort_latency_seconds <= observed

    # The engine keeps serving, and the aborted request takes no further step.
    assert isinstance((await collect(engine.submit(make_request("b", 1))))[-1], Completed)
    assert adapter.step_calls == [["a"], ["a"], ["b"]]
    assert adapter.finished == ["b"]
    adapter.assert_released_once()
    assert sample(registry, "stagemesh_steps_total") == 3
    assert sample(registry, "stagemesh_requests_finished_total", status="aborted") == 1
    assert sample(registry, "stagemesh_abort_latency_seconds_count") == 1


async def test_cancel_during_the_final_step_yields_no_completed(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter)
    engine.start()
    stream = engine.submit(make_request("a", total_steps=1))
    await entered_step(adapter)  # this step reports finished=True, but the cancel wins

    engine.abort("a", AbortReason.RPC_CANCELLED)
    adapter.open()
    events = await collect(stream)
    assert kinds(events) == [Queued, Aborted]
    assert as_aborted(events[-1]).reason is AbortReason.RPC_CANCELLED
    assert adapter.finished == [] and len(adapter.step_calls) == 1
    adapter.assert_released_once()


@pytest.mark.parametrize(
    ("phase", "error", "expected"),
    [
        ("step", RuntimeError("gpu on fire"), Failed("gpu on fire")),
        ("prepare", RuntimeError("prepare exploded"), Failed("prepare exploded")),
        ("prepare", InvalidInputError("seed", "seed too big"), Failed("seed too big", "seed")),
    ],
)
async def test_an_adapter_exception_fails_only_that_request(
    make_engine: EngineFactory, phase: str, error: Exception, expected: Failed
) -> None:
    adapter = FakeAdapter()
    adapter.fail["a"] = (phase, error)
    engine = make_engine(adapter)
    failing, next_one = engine.submit(make_request("a")), engine.submit(make_request("b"))
    engine.start()

    assert (await collect(failing))[-1] == expected
    assert isinstance((await collect(next_one))[-1], Completed)
    assert (["a"] in adapter.step_calls) == (phase == "step")
    adapter.assert_released_once()


async def test_a_failing_step_fails_only_the_request_that_makes_it_fail(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    """Failure isolation: the batch that raised is stepped again one request at a time; the
    innocent get exactly the result they get alone (no step applied twice)."""
    solo = make_engine(FakeAdapter())
    solo.start()
    solo_ends = [(await collect(solo.submit(make_request(rid, key=key))))[-1]
                 for rid, key in [("b", "512"), ("c", "256")]]

    adapter = FakeAdapter()
    adapter.fail["a"] = ("step", RuntimeError("gpu on fire"))
    engine = make_engine(adapter, max_running=3)
    streams = [
        engine.submit(make_request(rid, key=key))
        for rid, key in [("a", "512"), ("b", "512"), ("c", "256")]
    ]
    engine.start()
    events = [await collect(stream) for stream in streams]
    assert events[0][-1] == Failed("gpu on fire")
    assert [e[-1] for e in events[1:]] == solo_ends == [
        Completed(result=("b", 3, ()), step_index=3), Completed(result=("c", 3, ()), step_index=3)
    ]
    assert [e.step_index for e in events[1] if isinstance(e, Progress)] == [1, 2, 3]
    # The batch of a and b raised and was stepped again one by one, before c's batch (both keys
    # step in their first tick, the more urgent first); then b and c stepped on alone, in turns
    # that follow the measured step times (see the scheduler's tests for those).
    assert adapter.step_calls[:4] == [["a", "b"], ["a"], ["b"], ["c"]]
    assert sorted(adapter.step_calls[4:]) == [["b"], ["b"], ["c"], ["c"]]
    assert sample(registry, "stagemesh_isolated_step_failures_total") == 1
    assert sample(registry, "stagemesh_requests_finished_total", status="failed") == 1
    adapter.assert_released_once()


async def test_a_batch_of_innocents_survives_several_culprits(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter()
    for rid in ("a", "c"):
        adapter.fail[rid] = ("step", RuntimeError(f"{rid} is cursed"))
    engine = make_engine(adapter, max_running=4)
    streams = [engine.submit(make_request(rid, total_steps=2)) for rid in "abcd"]
    engine.start()
    ends = [(await collect(stream))[-1] for stream in streams]
    assert ends == [
        Failed("a is cursed"), Completed(result=("b", 2, ()), step_index=2),
        Failed("c is cursed"), Completed(result=("d", 2, ()), step_index=2),
    ]
    assert adapter.step_calls == [["a", "b", "c", "d"], ["a"], ["b"], ["c"], ["d"], ["b", "d"]]
    adapter.assert_released_once()


async def test_a_step_with_the_wrong_number_of_outputs_fails_the_batch_without_a_rerun(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    """Its states did advance, so stepping them again would apply the step twice."""
    adapter = FakeAdapter()
    adapter.short_results = True
    engine = make_engine(adapter, max_running=2)
    streams = [engine.submit(make_request(rid)) for rid in "ab"]
    engine.start()
    ends = [(await collect(stream))[-1] for stream in streams]
    assert ends == [Failed("step returned 1 outputs for 2 states")] * 2
    assert adapter.step_calls == [["a", "b"]]
    assert sample(registry, "stagemesh_isolated_step_failures_total") == 0
    adapter.assert_released_once()


async def test_abort_before_submit_wins(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    engine.start()
    engine.abort("early", AbortReason.RPC_CANCELLED)
    events = await collect(engine.submit(make_request("early")))

    assert kinds(events) == [Aborted]
    assert as_aborted(events[0]).reason is AbortReason.RPC_CANCELLED
    assert adapter.prepared == [] and adapter.step_calls == []
    # The tombstone is used up: the same id can be submitted again afterwards.
    assert isinstance((await collect(engine.submit(make_request("early"))))[-1], Completed)


async def test_expired_deadline_while_waiting_is_never_prepared(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    engine.start()
    request = make_request("late", deadline=time.monotonic() - 0.001)
    events = await collect(engine.submit(request))

    assert kinds(events) == [Queued, Aborted]
    assert as_aborted(events[-1]).reason is AbortReason.DEADLINE_EXCEEDED
    assert adapter.prepared == []


async def test_deadline_stops_a_running_request_after_its_step(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter)
    engine.start()
    deadline = time.monotonic() + 0.5
    stream = engine.submit(make_request("a", total_steps=5, deadline=deadline))
    adapter.allow(1)
    await entered_step(adapter)
    await entered_step(adapter)
    adapter.open_after(deadline)  # step 2 ends once the deadline has passed

    events = await collect(stream)
    assert kinds(events) == [Queued, Progress, Progress, Aborted]
    end = as_aborted(events[-1])
    assert (end.step_index, end.reason) == (2, AbortReason.DEADLINE_EXCEEDED)
    assert len(adapter.step_calls) == 2
    adapter.assert_released_once()


async def test_deadline_wakes_an_idle_engine_and_input_wait_takes_no_steps(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    engine.start()
    request = make_request("mute", total_steps=None, deadline=time.monotonic() + 0.5,
                           streamed=True)
    events = await collect(engine.submit(request))

    assert kinds(events) == [Queued, Progress, Aborted]
    assert as_aborted(events[-1]).reason is AbortReason.DEADLINE_EXCEEDED
    assert adapter.step_calls == [["mute"]]  # one step found no input; then none until input
    adapter.assert_released_once()


async def test_streamed_input_before_and_after_prepare(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    stream = engine.submit(make_request("codec", total_steps=None, streamed=True))
    engine.add_input("codec", 1)  # arrives before the request is prepared
    engine.add_input("unknown", 99)  # ignored
    engine.start()
    first = [await next_event(stream) for _ in range(3)]
    assert kinds(first) == [Queued, Progress, Partial] and first[2] == Partial(2)

    engine.add_input("codec", 2)
    engine.add_input("codec", None)  # end of input: the next step finishes
    rest = await collect(stream)
    assert kinds(rest) == [Progress, Partial, Progress, Completed]
    assert [e.step_index for e in rest if isinstance(e, Progress)] == [2, 2]
    assert rest[1] == Partial(4)
    assert rest[-1] == Completed(result=("codec", 2, (2, 4)), step_index=2)
    adapter.assert_released_once()


@pytest.mark.parametrize("adapter_cls", [FakeAdapter, InterruptibleAdapter])
async def test_request_mode_ignores_aborts_and_gives_the_same_result(
    make_engine: EngineFactory, adapter_cls: type[FakeAdapter]
) -> None:
    step_adapter = FakeAdapter()
    step_engine = make_engine(step_adapter)
    step_engine.start()
    step_events = await collect(step_engine.submit(make_request("a", total_steps=3)))

    adapter = adapter_cls(gated=True)
    engine = make_engine(adapter, mode=ExecutionMode.REQUEST)
    engine.start()
    stream = engine.submit(make_request("a", total_steps=3))
    await entered_step(adapter)
    engine.abort("a")
    await asyncio.sleep(20 * BLOCK_SECONDS)  # an interruptible step sees many blocks pass
    adapter.open()
    events = await collect(stream)

    assert kinds(events) == kinds(step_events)
    assert events[-1] == step_events[-1] == Completed(result=("a", 3, ()), step_index=3)
    assert len(adapter.step_calls) == len(step_adapter.step_calls) == 3
    assert not isinstance(adapter, InterruptibleAdapter) or adapter.interrupted == 0
    adapter.assert_released_once()


async def test_a_request_can_ask_for_request_mode_in_a_step_engine(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter)  # STEP by default
    engine.start()
    request = make_request("a", total_steps=3, mode=ExecutionMode.REQUEST)
    stream = engine.submit(request)
    await entered_step(adapter)
    engine.abort("a")
    adapter.open()
    events = await collect(stream)

    assert events[-1] == Completed(result=("a", 3, ()), step_index=3)
    assert len(adapter.step_calls) == 3


@pytest.mark.parametrize(
    ("keys", "first_tick", "later_calls"),
    # Every key steps in its first tick, the more urgent first; later turns follow the measured
    # step times (the scheduler's tests pin those down).
    [(("k", "k"), [["a", "b"]], [["a", "b"]]), (("k", "other"), [["a"], ["b"]], [["a"], ["b"]])],
)
async def test_requests_with_the_same_batch_key_share_a_step(
    make_engine: EngineFactory,
    keys: tuple[str, str],
    first_tick: list[list[str]],
    later_calls: list[list[str]],
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter, max_running=2)
    streams = [
        engine.submit(make_request(rid, 2, key=key)) for rid, key in zip("ab", keys, strict=True)
    ]
    engine.start()
    for stream in streams:
        assert isinstance((await collect(stream))[-1], Completed)
    assert adapter.step_calls[: len(first_tick)] == first_tick
    assert sorted(adapter.step_calls[len(first_tick) :]) == later_calls


class CostlyAdapter(FakeAdapter):
    """A FakeAdapter whose step calls take a set wall time per batch key (none if not set)."""

    def __init__(self, seconds_per_step: dict[str, float]) -> None:
        super().__init__()
        self.seconds_per_step = seconds_per_step

    def step(self, states: Sequence[FakeState]) -> list[StepOutput[int]]:
        time.sleep(self.seconds_per_step.get(states[0].key, 0.0))
        return super().step(states)


async def test_a_cheap_batch_key_is_not_held_back_by_a_dear_one(
    make_engine: EngineFactory,
) -> None:
    """The engine charges each step call's wall time to its batch key, so the scheduler's turns
    share time, not ticks: the cheap key steps every tick, the dear one about once in
    MAX_TICKS_WITHOUT_STEP (16) ticks, and is never starved."""
    adapter = CostlyAdapter({"256": 0.05})
    engine = make_engine(adapter, max_running=2)
    large = engine.submit(make_request("large", 6, key="256"))
    small = engine.submit(make_request("small", 20, key="64"))
    engine.start()
    assert (await collect(small))[-1] == Completed(result=("small", 20, ()), step_index=20)
    assert (await collect(large))[-1] == Completed(result=("large", 6, ()), step_index=6)

    calls = adapter.step_calls
    assert calls[:2] == [["large"], ["small"]]  # both keys step in their first tick
    last_small = max(i for i, call in enumerate(calls) if call == ["small"])
    # 2 (ticks 1 and 17) unless the cheap steps are slowed a lot; fair turns would give 6.
    assert 1 <= calls[:last_small].count(["large"]) <= 4
    adapter.assert_released_once()


async def test_shutdown_aborts_in_flight_work_and_the_thread_exits(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter, max_running=1)
    running = engine.submit(make_request("forever", total_steps=None))
    waiting = engine.submit(make_request("queued"))
    engine.start()
    assert isinstance(await next_event(running), Queued)
    assert isinstance(await next_event(running), Progress)

    assert await asyncio.to_thread(engine.shutdown, True, WAIT)
    assert not engine.is_alive
    for stream in (running, waiting):
        end = (await collect(stream))[-1]
        assert isinstance(end, Aborted) and end.reason is AbortReason.SHUTDOWN
    assert adapter.prepared == ["forever"]
    adapter.assert_released_once()
    with pytest.raises(RuntimeError):
        engine.submit(make_request("too-late"))


async def test_shutdown_without_abort_lets_running_work_finish(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter)
    engine.start()
    stream = engine.submit(make_request("a", total_steps=2))
    await entered_step(adapter)
    assert not engine.shutdown(abort_running=False, timeout=0)  # queued; the step still runs
    adapter.open()

    assert await asyncio.to_thread(engine.shutdown, False, WAIT)
    assert isinstance((await collect(stream))[-1], Completed)


async def test_bad_input_fails_fast_in_submit(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter)
    engine.start()
    with pytest.raises(InvalidInputError) as caught:
        engine.submit(make_request("a", prompt=""))
    assert caught.value.field_name == "prompt"
    with pytest.raises(InvalidInputError) as caught:
        engine.submit(make_request("b", total_steps=0))
    assert caught.value.field_name == "num_inference_steps"

    engine.submit(make_request("c"))
    with pytest.raises(InvalidInputError) as caught:
        engine.submit(make_request("c"))
    assert caught.value.field_name == "request_id"
    assert not {"a", "b"} & set(adapter.prepared)


async def test_a_full_engine_refuses_new_requests(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter, max_pending=2)
    engine.start()
    first, second = engine.submit(make_request("a")), engine.submit(make_request("b"))
    with pytest.raises(QueueFullError, match="limit 2"):
        engine.submit(make_request("c"))
    adapter.open()
    await collect(first)
    await collect(second)
    assert isinstance((await collect(engine.submit(make_request("c"))))[-1], Completed)


# -- batches, priorities, preemption ------------------------------------------------------------


def progress_steps(events: list[FakeEvent]) -> list[int]:
    return [e.step_index for e in events if isinstance(e, Progress)]


async def first_step_held(
    make_engine: EngineFactory,
    first: EngineRequest[FakeInput],
    *,
    max_running: int,
    max_batch: int | None = None,
) -> tuple[FakeAdapter, FakeEngine, FakeStream]:
    """A gated engine whose first request is in its first step, held there."""
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter, max_running=max_running, max_batch=max_batch)
    stream = engine.submit(first)
    engine.start()
    await entered_step(adapter)
    return adapter, engine, stream


async def test_at_most_max_batch_requests_run_and_share_a_step_by_key(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter, max_running=4, max_batch=2)
    assert (engine.max_running, engine.max_batch) == (4, 2)
    keys = dict(zip("abcde", "xxyxy", strict=True))
    streams = [engine.submit(make_request(rid, 2, key=key)) for rid, key in keys.items()]
    engine.start()
    ends = [(await collect(stream))[-1] for stream in streams]

    assert ends == [Completed(result=(rid, 2, ()), step_index=2) for rid in keys]
    assert adapter.step_calls[:2] == [["a", "b"], ["a", "b"]]  # one step for both, each tick
    assert all(len(call) <= 2 for call in adapter.step_calls)
    assert all(len({keys[rid] for rid in call}) == 1 for call in adapter.step_calls)
    assert sum(map(len, adapter.step_calls)) == 2 * len(keys)  # every step ran exactly once
    assert adapter.most_held == 2  # equal priorities: nobody preempted, nobody over max_batch
    adapter.assert_released_once()


def test_max_batch_never_exceeds_max_running(make_engine: EngineFactory) -> None:
    engine = make_engine(FakeAdapter(), max_running=2, max_batch=8)
    assert (engine.max_running, engine.max_batch) == (2, 2)
    assert make_engine(FakeAdapter(), max_running=3).max_batch == 3


async def test_lower_priority_value_runs_first(make_engine: EngineFactory) -> None:
    # first holds the only slot; the rest queue behind it
    adapter, engine, first = await first_step_held(make_engine, make_request("first", 1),
                                                   max_running=1)
    streams = [engine.submit(make_request(rid, 1, priority=priority))
               for rid, priority in [("low", 5), ("mid", 1), ("high", 0), ("mid2", 1)]]
    adapter.open()
    for stream in [first, *streams]:
        assert isinstance((await collect(stream))[-1], Completed)
    assert adapter.prepared == ["first", "high", "mid", "mid2", "low"]


async def test_a_more_urgent_request_preempts_and_the_preempted_one_resumes_unchanged(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    solo = make_engine(FakeAdapter())
    solo.start()
    solo_events = await collect(solo.submit(make_request("low", 4, priority=5)))

    # low's first step is in flight when high arrives
    adapter, engine, low = await first_step_held(
        make_engine, make_request("low", 4, priority=5), max_running=2, max_batch=1)
    high = engine.submit(make_request("high", 2, priority=0))
    adapter.open()
    low_events, high_events = await collect(low), await collect(high)

    assert kinds(low_events) == [Queued, Progress, Preempted, Progress, Progress, Progress,
                                 Completed]
    assert low_events[2] == Preempted(step_index=1)
    assert progress_steps(low_events) == progress_steps(solo_events) == [1, 2, 3, 4]
    assert low_events[-1] == solo_events[-1] == Completed(result=("low", 4, ()), step_index=4)
    assert kinds(high_events) == [Queued, Progress, Progress, Completed]
    assert adapter.prepared == ["low", "high"]  # low kept its state: prepared once
    assert adapter.step_calls == [["low"], ["high"], ["high"], ["low"], ["low"], ["low"]]
    assert sample(registry, "stagemesh_preemptions_total") == 1
    assert sample(registry, "stagemesh_requests_preempted") == 0
    adapter.assert_released_once()


async def test_preemption_never_holds_more_than_max_running_states(
    make_engine: EngineFactory,
) -> None:
    adapter, engine, low = await first_step_held(
        make_engine, make_request("low", 3, priority=5), max_running=2, max_batch=1)
    mid = engine.submit(make_request("mid", 2, priority=1))
    high = engine.submit(make_request("high", 2, priority=0))
    adapter.open()
    low_events, mid_events, high_events = [await collect(s) for s in (low, mid, high)]

    # high preempts low; mid, more urgent than low too, waits unprepared: a third holder would
    # be over max_running. It runs when high is done; low resumes last.
    assert adapter.most_held == 2
    assert adapter.prepared == ["low", "high", "mid"]
    assert adapter.step_calls == [["low"], ["high"], ["high"], ["mid"], ["mid"], ["low"],
                                  ["low"]]
    assert [e for e in low_events if isinstance(e, Preempted)] == [Preempted(step_index=1)]
    assert Preempted not in kinds(mid_events) + kinds(high_events)
    assert all(isinstance(events[-1], Completed)
               for events in (low_events, mid_events, high_events))
    adapter.assert_released_once()


async def test_equal_priorities_never_preempt(make_engine: EngineFactory) -> None:
    adapter, engine, first = await first_step_held(make_engine, make_request("first", 2),
                                                   max_running=4, max_batch=1)
    later = engine.submit(make_request("later", 2))
    adapter.open()
    assert Preempted not in kinds(await collect(first))
    assert Preempted not in kinds(await collect(later))
    assert adapter.step_calls == [["first"], ["first"], ["later"], ["later"]]


async def test_a_preempted_request_can_be_aborted_and_is_never_stepped_again(
    make_engine: EngineFactory,
) -> None:
    adapter, engine, low = await first_step_held(  # low's step 1 is held
        make_engine, make_request("low", 4, priority=5), max_running=2, max_batch=1)
    high = engine.submit(make_request("high", 3, priority=0))
    adapter.allow(2)  # low's step 1, then high's step 1
    await entered_step(adapter)
    await entered_step(adapter)  # high's step 2 is held: low waits, preempted
    assert kinds([await next_event(low) for _ in range(3)]) == [Queued, Progress, Preempted]

    engine.abort("low")
    adapter.open()
    end = as_aborted(await next_event(low))
    assert (end.step_index, end.reason) == (1, AbortReason.CANCELLED)
    assert isinstance((await collect(high))[-1], Completed)
    assert adapter.step_calls == [["low"], ["high"], ["high"], ["high"]]
    assert adapter.prepared == ["low", "high"] and adapter.finished == ["high"]
    adapter.assert_released_once()


# -- mid-step abort -------------------------------------------------------------------------------


async def test_a_step_whose_requests_are_all_cancelled_stops_part_way(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    adapter = InterruptibleAdapter(gated=True)
    engine = make_engine(adapter, max_running=2)
    assert adapter.interrupt is not None  # bound once, at construction
    streams = [engine.submit(make_request(rid, total_steps=5)) for rid in "ab"]
    engine.start()
    adapter.allow(1)
    await entered_step(adapter)
    await entered_step(adapter)  # step 2 is held open: without an interrupt it never ends

    signalled = time.monotonic()
    engine.abort("a")
    engine.abort("b", AbortReason.RPC_CANCELLED)
    ends = [(await collect(stream))[-1] for stream in streams]
    observed = time.monotonic() - signalled

    assert [(as_aborted(end).step_index, as_aborted(end).reason) for end in ends] == [
        (1, AbortReason.CANCELLED), (1, AbortReason.RPC_CANCELLED)
    ]
    assert observed < WAIT / 3  # well before the held step could have ended
    assert all(0 < as_aborted(end).abort_latency_seconds <= observed for end in ends)
    assert adapter.interrupted == 1 and adapter.step_calls == [["a", "b"], ["a", "b"]]
    assert adapter.finished == []
    assert sample(registry, "stagemesh_forward_interrupts_total") == 1
    assert sample(registry, "stagemesh_abort_latency_seconds_count") == 2
    assert sample(registry, "stagemesh_steps_total") == 2  # the stopped step is not counted
    assert sample(registry, "stagemesh_requests_finished_total", status="failed") == 0
    adapter.assert_released_once()

    # The engine serves on.
    adapter.open()
    assert isinstance((await collect(engine.submit(make_request("c", 1))))[-1], Completed)


async def test_a_step_that_still_serves_someone_runs_to_its_end(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    adapter = InterruptibleAdapter(gated=True)
    engine = make_engine(adapter, max_running=2)
    cancelled, kept = [engine.submit(make_request(rid, total_steps=3)) for rid in "ab"]
    engine.start()
    adapter.allow(1)
    await entered_step(adapter)
    await entered_step(adapter)

    engine.abort("a")
    await asyncio.sleep(20 * BLOCK_SECONDS)  # many blocks pass: b still wants this step
    assert adapter.interrupted == 0
    adapter.open()
    cancelled_events, kept_events = await collect(cancelled), await collect(kept)

    assert as_aborted(cancelled_events[-1]).step_index == 1  # its step-2 output is dropped
    assert kept_events[-1] == Completed(result=("b", 3, ()), step_index=3)
    assert progress_steps(kept_events) == [1, 2, 3]
    assert adapter.step_calls == [["a", "b"], ["a", "b"], ["b"]]
    assert sample(registry, "stagemesh_forward_interrupts_total") == 0
    adapter.assert_released_once()


async def test_a_cancel_between_steps_stops_the_next_step_at_once(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    """The cancel lands while no step is armed; the next step of that request stops at its
    first block instead of running (or the request leaves before it)."""
    adapter = InterruptibleAdapter(gated=True)
    engine = make_engine(adapter)
    stream = engine.submit(make_request("a", total_steps=5))
    engine.start()
    adapter.allow(1)
    await entered_step(adapter)
    await entered_step(adapter)
    assert adapter.interrupt is not None
    adapter.interrupt.disarm()  # as if step 2 had just ended: the cancel lands in the gap
    engine.abort("a")
    adapter.interrupt.arm(["a"])  # and the next step starts
    events = await collect(stream)
    assert as_aborted(events[-1]).step_index == 1
    assert adapter.interrupted == 1
    assert sample(registry, "stagemesh_forward_interrupts_total") == 1
    adapter.assert_released_once()


async def test_shutdown_stops_a_step_part_way(make_engine: EngineFactory) -> None:
    adapter = InterruptibleAdapter(gated=True)
    engine = make_engine(adapter)
    stream = engine.submit(make_request("a", total_steps=5))
    engine.start()
    await entered_step(adapter)  # held open

    started = time.monotonic()
    assert await asyncio.to_thread(engine.shutdown, True, WAIT)
    assert time.monotonic() - started < WAIT / 3
    end = as_aborted((await collect(stream))[-1])
    assert (end.step_index, end.reason) == (0, AbortReason.SHUTDOWN)
    assert adapter.interrupted == 1
    adapter.assert_released_once()
