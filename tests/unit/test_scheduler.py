"""Scheduler behaviour, ported from the seed's scheduler tests: no model, no thread."""

from __future__ import annotations

import pytest

from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.request import AbortReason, RequestState
from stagemesh.shared.engine.scheduler import (
    MISSING_STEP_INDEX,
    Scheduler,
    TickPlan,
    resolve_total_steps,
)


def make_request(
    rid: str,
    total_steps: int | None = 3,
    start_step: int = 0,
    priority: int = 0,
    deadline: float | None = None,
) -> EngineRequest[None]:
    return EngineRequest(
        request_id=rid,
        payload=None,
        budget=StepBudget(total_steps=total_steps, start_step=start_step),
        deadline=deadline,
        priority=priority,
    )


def schedule_and_prepare(scheduler: Scheduler, key: str = "k") -> TickPlan:
    """What the engine does at the top of a tick: schedule, then prepare the newly admitted."""
    plan = scheduler.schedule()
    for rid in plan.to_prepare:
        scheduler.mark_prepared(rid, key)
    return plan


def start_running(scheduler: Scheduler, *rids: str) -> None:
    """Admit and prepare `rids` so that the next schedule() steps them."""
    for rid in rids:
        scheduler.add_request(make_request(rid))
    schedule_and_prepare(scheduler)


def state_of(scheduler: Scheduler, rid: str) -> RequestState:
    record = scheduler.get(rid)
    assert record is not None
    return record.state


def test_single_request_step_lifecycle_records_step_index() -> None:
    scheduler = Scheduler()
    scheduler.add_request(make_request("a", total_steps=3))
    assert state_of(scheduler, "a") is RequestState.WAITING

    plan = schedule_and_prepare(scheduler)
    assert (plan.step_id, plan.to_prepare, plan.batches) == (0, ["a"], [])
    assert (plan.num_running, plan.num_waiting) == (1, 0)

    for step in (1, 2, 3):
        plan = scheduler.schedule()
        assert plan.step_id == step
        assert plan.to_prepare == [] and plan.batches == [["a"]]
        finished = scheduler.update_from_output(
            plan, {"a": StepOutput(step_index=step, finished=step == 3)}
        )
        record = scheduler.get("a")
        assert record is not None and record.step_index == step
        if step < 3:
            assert finished == set() and record.state is RequestState.RUNNING
    assert finished == {"a"}
    assert state_of(scheduler, "a") is RequestState.FINISHED_COMPLETED
    assert not scheduler.has_requests()
    assert scheduler.schedule().finished == {"a"}


def test_fifo_admits_one_at_a_time() -> None:
    scheduler = Scheduler(max_running=1)
    start_running(scheduler, "a", "b")
    plan = scheduler.schedule()
    assert plan.batches == [["a"]] and (plan.num_running, plan.num_waiting) == (1, 1)
    assert state_of(scheduler, "b") is RequestState.WAITING

    scheduler.update_from_output(plan, {"a": StepOutput(step_index=1, finished=True)})
    plan = scheduler.schedule()
    assert plan.to_prepare == ["b"] and plan.finished == {"a"}


def test_priority_runs_first_and_fifo_among_equals() -> None:
    scheduler = Scheduler(max_running=3)
    for rid, priority in [("low1", 5), ("high", 0), ("low2", 5), ("mid", 1)]:
        scheduler.add_request(make_request(rid, priority=priority))
    assert [scheduler.position(rid) for rid in ("high", "mid", "low1", "low2")] == [0, 1, 2, 3]
    assert scheduler.schedule().to_prepare == ["high", "mid", "low1"]


@pytest.mark.parametrize(
    ("timesteps", "sigmas", "num_inference_steps", "expected"),
    [
        ([1.0, 0.5, 0.0], [1.0, 0.75, 0.5, 0.0], 5, 3),
        (None, [1.0, 0.5], 5, 2),
        (None, None, 4, 4),
    ],
)
def test_total_steps_priority(
    timesteps: list[float] | None,
    sigmas: list[float] | None,
    num_inference_steps: int,
    expected: int,
) -> None:
    assert resolve_total_steps(timesteps, sigmas, num_inference_steps) == expected


def test_total_steps_skips_empty_sequences_and_counts_zero_dim_as_one() -> None:
    class ZeroDim:
        shape = ()

    assert resolve_total_steps([], [], 7) == 7
    assert resolve_total_steps([], [0.5, 0.0], 7) == 2
    assert resolve_total_steps(ZeroDim(), None, 7) == 1  # type: ignore[arg-type]
    assert resolve_total_steps(None, None, None) is None


@pytest.mark.parametrize(
    ("total_steps", "start_step", "field_name", "quoted"),
    [
        (0, 0, "num_inference_steps", "got 0"),
        (3, 3, "step_index", "step_index 3"),
        (3, -1, "step_index", "step_index -1"),
    ],
)
def test_rejects_invalid_initial_step_state(
    total_steps: int, start_step: int, field_name: str, quoted: str
) -> None:
    scheduler = Scheduler()
    with pytest.raises(InvalidInputError) as caught:
        scheduler.add_request(make_request("bad-req", total_steps, start_step))
    assert caught.value.field_name == field_name
    assert "bad-req" in str(caught.value) and quoted in str(caught.value)
    assert not scheduler.has_requests()


def test_open_ended_budget_is_accepted_but_not_a_negative_start() -> None:
    scheduler = Scheduler()
    scheduler.add_request(make_request("open", total_steps=None))
    with pytest.raises(InvalidInputError) as caught:
        scheduler.add_request(make_request("neg", total_steps=None, start_step=-2))
    assert caught.value.field_name == "step_index"


def test_start_step_is_the_initial_step_index() -> None:
    scheduler = Scheduler()
    scheduler.add_request(make_request("a", total_steps=5, start_step=2))
    record = scheduler.get("a")
    assert record is not None and record.step_index == 2


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = Scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(InvalidInputError) as caught:
        scheduler.add_request(make_request("a"))
    assert caught.value.field_name == "request_id"


def test_preemption_keeps_step_index_and_resumes_without_prepare() -> None:
    scheduler = Scheduler(max_running=1)
    start_running(scheduler, "a", "b")
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"a": StepOutput(step_index=1)})

    assert scheduler.preempt_request("a")
    record = scheduler.get("a")
    assert record is not None
    assert (record.state, record.step_index) == (RequestState.PREEMPTED, 1)
    assert scheduler.position("a") == 0  # front of the queue, ahead of b

    plan = scheduler.schedule()
    assert plan.resumed == ["a"] and plan.to_prepare == [] and plan.batches == [["a"]]
    assert (record.state, record.step_index) == (RequestState.RUNNING, 1)
    assert not scheduler.preempt_request("b")  # only a running request can be preempted
    assert not scheduler.preempt_request("unknown")


def test_aborted_between_schedule_and_update_is_returned_finished() -> None:
    scheduler = Scheduler()
    start_running(scheduler, "a")
    plan = scheduler.schedule()
    assert scheduler.finish_requests("a", RequestState.FINISHED_ABORTED, AbortReason.CANCELLED)

    finished = scheduler.update_from_output(plan, {"a": StepOutput(step_index=1, finished=True)})
    record = scheduler.get("a")
    assert finished == {"a"}
    assert record is not None
    assert (record.state, record.step_index) == (RequestState.FINISHED_ABORTED, 0)
    assert record.abort_reason is AbortReason.CANCELLED and record.abort_signal_at is not None
    assert scheduler.schedule().batches == []  # not re-queued


def test_missing_step_index_fails_that_request() -> None:
    scheduler = Scheduler()
    start_running(scheduler, "a")
    plan = scheduler.schedule()
    assert scheduler.update_from_output(plan, {"a": StepOutput(step_index=None)}) == {"a"}
    record = scheduler.get("a")
    assert record is not None
    assert (record.state, record.error) == (RequestState.FINISHED_ERROR, MISSING_STEP_INDEX)
    assert MISSING_STEP_INDEX == "Missing step_index in step output"


def test_error_output_marks_finished_error() -> None:
    scheduler = Scheduler()
    start_running(scheduler, "a")
    plan = scheduler.schedule()
    output: StepOutput[None] = StepOutput(step_index=1, finished=True, error="worker failed")
    assert scheduler.update_from_output(plan, {"a": output}) == {"a"}
    record = scheduler.get("a")
    assert record is not None
    assert (record.state, record.error) == (RequestState.FINISHED_ERROR, "worker failed")
    assert not scheduler.has_requests()


def test_output_for_unknown_or_unscheduled_ids_is_ignored() -> None:
    scheduler = Scheduler()
    start_running(scheduler, "a")
    plan = scheduler.schedule()
    outputs: dict[str, StepOutput[None]] = {
        "a": StepOutput(step_index=1), "ghost": StepOutput(step_index=9, finished=True)
    }
    assert scheduler.update_from_output(plan, outputs) == set()
    assert scheduler.get("ghost") is None


def test_abort_waiting_and_running() -> None:
    scheduler = Scheduler(max_running=1)
    scheduler.add_request(make_request("a"))
    scheduler.add_request(make_request("b"))
    assert schedule_and_prepare(scheduler).to_prepare == ["a"]

    assert scheduler.finish_requests("b", RequestState.FINISHED_ABORTED) == {"b"}
    assert state_of(scheduler, "b") is RequestState.FINISHED_ABORTED
    assert scheduler.num_waiting == 0
    plan = scheduler.schedule()
    assert plan.finished == {"b"} and plan.to_prepare == [] and plan.batches == [["a"]]
    assert scheduler.schedule().finished == set()  # reported once

    assert scheduler.finish_requests(["a"], RequestState.FINISHED_ABORTED) == {"a"}
    assert state_of(scheduler, "a") is RequestState.FINISHED_ABORTED
    assert not scheduler.has_requests()


def test_aborted_waiting_request_is_never_offered_for_prepare() -> None:
    scheduler = Scheduler(max_running=1)
    start_running(scheduler, "a")
    scheduler.add_request(make_request("b"))
    scheduler.finish_requests("b", RequestState.FINISHED_ABORTED)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"a": StepOutput(step_index=1, finished=True)})
    assert scheduler.schedule().to_prepare == []


def test_repeated_and_unknown_aborts_are_harmless() -> None:
    scheduler = Scheduler(max_running=1)
    start_running(scheduler, "a", "b")
    aborted = RequestState.FINISHED_ABORTED
    assert scheduler.finish_requests("nope", aborted) == set()
    assert scheduler.finish_requests(["a", "a"], aborted) == {"a"}
    assert scheduler.finish_requests("a", aborted, AbortReason.SHUTDOWN) == set()
    record = scheduler.get("a")
    assert record is not None and record.abort_reason is AbortReason.CANCELLED  # first one stands
    assert scheduler.finish_requests(None, aborted, AbortReason.SHUTDOWN) == {"b"}
    assert scheduler.finish_requests(None, aborted) == set()
    assert not scheduler.has_requests()


def test_has_requests_state_transition() -> None:
    scheduler = Scheduler()
    assert not scheduler.has_requests()
    scheduler.add_request(make_request("a", total_steps=1))
    assert scheduler.has_requests()
    schedule_and_prepare(scheduler)
    plan = scheduler.schedule()
    assert scheduler.has_requests()
    scheduler.update_from_output(plan, {"a": StepOutput(step_index=1, finished=True)})
    assert not scheduler.has_requests()
    assert scheduler.pop("a") is not None and scheduler.get("a") is None
    assert scheduler.pop("a") is None


def test_batches_group_by_key_up_to_max_running() -> None:
    scheduler = Scheduler(max_running=3)
    for rid in ("a", "b", "c", "d"):
        scheduler.add_request(make_request(rid))
    plan = scheduler.schedule()
    assert plan.to_prepare == ["a", "b", "c"] and plan.num_waiting == 1
    for rid, key in zip(plan.to_prepare, ["512x512", "256x256", "512x512"], strict=True):
        scheduler.mark_prepared(rid, key)
    assert scheduler.schedule().batches == [["a", "c"], ["b"]]


def test_waiting_for_input_is_not_stepped_until_input_arrives() -> None:
    scheduler = Scheduler(max_running=2)
    start_running(scheduler, "a", "b")
    plan = scheduler.schedule()
    outputs: dict[str, StepOutput[None]] = {
        "a": StepOutput(step_index=1, waiting_for_input=True), "b": StepOutput(1)
    }
    scheduler.update_from_output(plan, outputs)
    assert scheduler.schedule().batches == [["b"]]
    scheduler.mark_input_ready("a")
    assert scheduler.schedule().batches == [["a", "b"]]


def test_expired_and_next_deadline() -> None:
    scheduler = Scheduler()
    scheduler.add_request(make_request("late", deadline=10.0))
    scheduler.add_request(make_request("early", deadline=5.0))
    scheduler.add_request(make_request("none"))
    assert scheduler.next_deadline() == 5.0
    assert scheduler.expired(now=4.0) == []
    assert sorted(scheduler.expired(now=10.0)) == ["early", "late"]


def test_input_that_arrives_during_a_step_is_not_lost() -> None:
    """The step said "waiting for input", but input landed before its output was applied."""
    scheduler = Scheduler()
    start_running(scheduler, "codec")
    plan = scheduler.schedule()
    assert plan.batches == [["codec"]]
    scheduler.mark_input_ready("codec")  # drained after the step, before update_from_output
    scheduler.update_from_output(plan, {"codec": StepOutput(step_index=1,
                                                           waiting_for_input=True)})
    assert scheduler.schedule().batches == [["codec"]]


def test_waiting_for_input_sleeps_until_input_arrives() -> None:
    scheduler = Scheduler()
    start_running(scheduler, "codec")
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"codec": StepOutput(step_index=1,
                                                           waiting_for_input=True)})
    assert scheduler.schedule().batches == []
    scheduler.mark_input_ready("codec")
    assert scheduler.schedule().batches == [["codec"]]
