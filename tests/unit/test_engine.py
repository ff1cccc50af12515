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
    Progress,
    Queued,
)
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.engine.request import AbortReason

pytestmark = pytest.mark.timeout(10)

WAIT = 3.0  # seconds any single wait may take before the test fails instead of hanging


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
    """

    stage = "fake"

    def __init__(self, *, gated: bool = False) -> None:
        self.prepared: list[str] = []
        self.released: list[str] = []
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
            assert self._gate.wait_for(lambda: self._open or self._permits > 0, WAIT)
            self._permits -= not self._open
            deadline = time.monotonic() + WAIT
            while (left := self._not_before - time.monotonic()) > 0:
                assert time.monotonic() < deadline, "open_after moment never came"
                self._gate.wait(left)
        for state in states:
            self._maybe_fail("step", state.request_id)
        return [self._advance(s) for s in states]

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


def make_request(
    rid: str,
    total_steps: int | None = 3,
    *,
    deadline: float | None = None,
    mode: ExecutionMode | None = None,
    prompt: str = "a prompt",
    key: str = "k",
    streamed: bool = False,
) -> EngineRequest[FakeInput]:
    return EngineRequest(
        request_id=rid,
        payload=FakeInput(prompt, key, streamed),
        budget=StepBudget(total_steps=total_steps),
        deadline=deadline,
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
        max_pending: int = 256,
    ) -> FakeEngine:
        engine = StepEngine(
            adapter,
            mode=mode,
            max_running=max_running,
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


async def test_a_failing_step_fails_its_batch_only(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter()
    adapter.fail["a"] = ("step", RuntimeError("gpu on fire"))
    engine = make_engine(adapter, max_running=3)
    streams = [
        engine.submit(make_request(rid, key=key))
        for rid, key in [("a", "512"), ("b", "512"), ("c", "256")]
    ]
    engine.start()
    ends = [(await collect(stream))[-1] for stream in streams]
    assert ends[:2] == [Failed("gpu on fire"), Failed("gpu on fire")]
    assert isinstance(ends[2], Completed)
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


async def test_request_mode_ignores_aborts_and_gives_the_same_result(
    make_engine: EngineFactory,
) -> None:
    step_adapter = FakeAdapter()
    step_engine = make_engine(step_adapter)
    step_engine.start()
    step_events = await collect(step_engine.submit(make_request("a", total_steps=3)))

    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter, mode=ExecutionMode.REQUEST)
    engine.start()
    stream = engine.submit(make_request("a", total_steps=3))
    await entered_step(adapter)
    engine.abort("a")
    adapter.open()
    events = await collect(stream)

    assert kinds(events) == kinds(step_events)
    assert events[-1] == step_events[-1] == Completed(result=("a", 3, ()), step_index=3)
    assert len(adapter.step_calls) == len(step_adapter.step_calls) == 3
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
    ("keys", "expected_calls"),
    [(("k", "k"), [["a", "b"]] * 2), (("k", "other"), [["a"], ["b"]] * 2)],
)
async def test_requests_with_the_same_batch_key_share_a_step(
    make_engine: EngineFactory, keys: tuple[str, str], expected_calls: list[list[str]]
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter, max_running=2)
    streams = [
        engine.submit(make_request(rid, 2, key=key)) for rid, key in zip("ab", keys, strict=True)
    ]
    engine.start()
    for stream in streams:
        assert isinstance((await collect(stream))[-1], Completed)
    assert adapter.step_calls == expected_calls


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
