"""StepEngine on its real compute thread, driven through a fake adapter whose steps the test
can hold open, so cancels land exactly where each test wants them. No model, no gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.engine import ExecutionMode, QueueFullError, RequestStream, StepEngine
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


@dataclass
class FakeState:
    request_id: str
    total: int | None
    step: int
    key: str
    streamed: bool  # consumes one add_input per step; None ends the input
    inputs: list[Any] = field(default_factory=list)
    produced: list[Any] = field(default_factory=list)


class FakeAdapter:
    """A StageAdapter that records every call. Gated: each step waits for a permit."""

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

    def allow(self, steps: int = 1) -> None:
        with self._gate:
            self._permits += steps
            self._gate.notify_all()

    def open(self) -> None:
        with self._gate:
            self._open = True
            self._gate.notify_all()

    def check_inputs(self, payload: dict[str, Any]) -> None:
        if payload.get("prompt") == "":
            raise InvalidInputError("prompt", "prompt must not be empty")

    def prepare(self, request: EngineRequest) -> FakeState:
        self._maybe_fail("prepare", request.request_id)
        self.prepared.append(request.request_id)
        payload = request.payload
        return FakeState(
            request_id=request.request_id,
            total=request.budget.total_steps,
            step=request.budget.start_step,
            key=payload.get("key", "k"),
            streamed=payload.get("streamed", False),
        )

    def add_input(self, state: FakeState, payload: Any) -> None:
        state.inputs.append(payload)

    def step(self, states: list[FakeState]) -> list[StepOutput]:
        self.step_calls.append([s.request_id for s in states])
        self.step_entered.release()
        with self._gate:
            assert self._gate.wait_for(lambda: self._open or self._permits > 0, WAIT)
            self._permits -= not self._open
        for state in states:
            self._maybe_fail("step", state.request_id)
        return [self._advance(s) for s in states]

    def _advance(self, state: FakeState) -> StepOutput:
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

    def finish(self, state: FakeState) -> Any:
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


def make_request(rid: str, total_steps: int | None = 3, **payload: Any) -> EngineRequest:
    return EngineRequest(
        request_id=rid, payload=payload, budget=StepBudget(total_steps=total_steps)
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


EngineFactory = Callable[..., StepEngine]


@pytest.fixture
def make_engine(registry: CollectorRegistry) -> Iterator[EngineFactory]:
    created: list[tuple[StepEngine, FakeAdapter]] = []

    def make(adapter: FakeAdapter, **kwargs: Any) -> StepEngine:
        engine = StepEngine(adapter, metrics=EngineMetrics("fake", registry), **kwargs)
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


async def collect(stream: RequestStream) -> list[Event]:
    async def drain() -> list[Event]:
        return [event async for event in stream]

    return await asyncio.wait_for(drain(), WAIT)


async def next_event(stream: RequestStream) -> Event:
    return await asyncio.wait_for(anext(stream), WAIT)


async def entered_step(adapter: FakeAdapter) -> None:
    assert await asyncio.to_thread(adapter.step_entered.acquire, True, WAIT)


def kinds(events: list[Event]) -> list[type]:
    return [type(event) for event in events]


async def test_events_are_queued_then_progress_then_completed(
    make_engine: EngineFactory, registry: CollectorRegistry
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    engine.start()
    events = await collect(engine.submit(make_request("a", total_steps=3)))

    assert kinds(events) == [Queued, Progress, Progress, Progress, Completed]
    assert events[0] == Queued(position=0)
    progress = [e for e in events if isinstance(e, Progress)]
    assert [(p.step_index, p.total_steps) for p in progress] == [(1, 3), (2, 3), (3, 3)]
    assert all(p.step_seconds >= 0 for p in progress)
    assert progress[0].elapsed_seconds <= progress[-1].elapsed_seconds
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

    engine.abort("a")
    engine.abort("a")  # repeated: harmless
    adapter.open()
    events = await collect(stream)
    assert kinds(events) == [Queued, Progress, Aborted]
    aborted = events[-1]
    assert isinstance(aborted, Aborted)
    assert (aborted.step_index, aborted.reason) == (1, AbortReason.CANCELLED)
    assert aborted.abort_latency_seconds >= 0

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
    assert events[-1].reason is AbortReason.RPC_CANCELLED  # type: ignore[union-attr]
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
    assert events[0].reason is AbortReason.RPC_CANCELLED  # type: ignore[union-attr]
    assert adapter.prepared == [] and adapter.step_calls == []
    # The tombstone is used up: the same id can be submitted again afterwards.
    assert isinstance((await collect(engine.submit(make_request("early"))))[-1], Completed)


async def test_expired_deadline_while_waiting_is_never_prepared(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    engine.start()
    request = make_request("late")
    request.deadline = time.monotonic() - 0.001
    events = await collect(engine.submit(request))

    assert kinds(events) == [Queued, Aborted]
    assert events[-1].reason is AbortReason.DEADLINE_EXCEEDED  # type: ignore[union-attr]
    assert adapter.prepared == []


async def test_deadline_stops_a_running_request_after_its_step(make_engine: EngineFactory) -> None:
    adapter = FakeAdapter(gated=True)
    engine = make_engine(adapter)
    engine.start()
    request = make_request("a", total_steps=5)
    request.deadline = time.monotonic() + 0.5
    stream = engine.submit(request)
    adapter.allow(1)
    await entered_step(adapter)
    await entered_step(adapter)
    await asyncio.sleep(max(0.0, request.deadline - time.monotonic()) + 0.01)
    adapter.open()

    events = await collect(stream)
    assert kinds(events) == [Queued, Progress, Progress, Aborted]
    assert events[-1].step_index == 2  # type: ignore[union-attr]
    assert events[-1].reason is AbortReason.DEADLINE_EXCEEDED  # type: ignore[union-attr]
    assert len(adapter.step_calls) == 2
    adapter.assert_released_once()


async def test_deadline_wakes_an_idle_engine_and_input_wait_takes_no_steps(
    make_engine: EngineFactory,
) -> None:
    adapter = FakeAdapter()
    engine = make_engine(adapter)
    engine.start()
    request = make_request("mute", total_steps=None, streamed=True)
    request.deadline = time.monotonic() + 0.5
    events = await collect(engine.submit(request))

    assert kinds(events) == [Queued, Progress, Aborted]
    assert events[-1].reason is AbortReason.DEADLINE_EXCEEDED  # type: ignore[union-attr]
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
    request = dataclasses.replace(make_request("a", total_steps=3), mode=ExecutionMode.REQUEST)
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
