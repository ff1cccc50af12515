"""Scheduler behaviour, ported from the seed's scheduler tests: no model, no thread."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

import pytest

from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.request import AbortReason, RequestState
from stagemesh.shared.engine.scheduler import (
    MAX_FORMING_WINDOWS,
    MAX_TICKS_WITHOUT_STEP,
    MISSING_STEP_INDEX,
    PRIORITY_AGING_SECONDS,
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


# -- run slots, batches, turns -----------------------------------------------------------------


class Clock:
    """A time.monotonic stand-in the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def finish_step(
    scheduler: Scheduler, plan: TickPlan, done: AbstractSet[str] = frozenset()
) -> set[str]:
    """Every batch of `plan` takes one step; the ids in `done` finish with it."""
    outputs: dict[str, StepOutput[None]] = {}
    for rid in plan.scheduled_ids:
        record = scheduler.get(rid)
        assert record is not None
        outputs[rid] = StepOutput(step_index=record.step_index + 1, finished=rid in done)
    return scheduler.update_from_output(plan, outputs)


def test_max_batch_caps_the_running_and_batches_split_by_key() -> None:
    scheduler = Scheduler(max_running=8, max_batch=3)
    assert (scheduler.max_running, scheduler.max_batch) == (8, 3)
    for rid in "abcdef":
        scheduler.add_request(make_request(rid))
    plan = scheduler.schedule()
    assert plan.to_prepare == ["a", "b", "c"] and (plan.num_running, plan.num_waiting) == (3, 3)
    for rid, key in zip(plan.to_prepare, ["x", "y", "x"], strict=True):
        scheduler.mark_prepared(rid, key)
    plan = scheduler.schedule()
    assert plan.batches == [["a", "c"], ["b"]] and plan.to_prepare == []

    finish_step(scheduler, plan, done={"a"})
    plan = scheduler.schedule()  # a's run slot goes to d, the next in line
    assert plan.to_prepare == ["d"] and plan.preempted == []
    assert plan.batches == [["b"], ["c"]]  # keys in urgency order: b is older than c
    assert all(len(batch) <= scheduler.max_batch for batch in plan.batches)


def test_max_batch_above_max_running_is_max_running() -> None:
    assert Scheduler(max_running=2, max_batch=5).max_batch == 2
    assert Scheduler(max_running=4).max_batch == 4


def start_keyed(
    scheduler: Scheduler, keys: Mapping[str, str], priorities: Mapping[str, int] | None = None
) -> None:
    """Admit and prepare one open-ended request per id of `keys`, with its batch key."""
    for rid in keys:
        priority = 0 if priorities is None else priorities.get(rid, 0)
        scheduler.add_request(make_request(rid, total_steps=None, priority=priority))
    plan = scheduler.schedule()
    for rid in plan.to_prepare:
        scheduler.mark_prepared(rid, keys[rid])


def step_charging(scheduler: Scheduler, costs: Mapping[str, float]) -> list[list[str]]:
    """One tick as the engine runs it: schedule, then step each batch, charging its key the
    batch's cost (`costs` by batch key). Returns the tick's batches."""
    plan = scheduler.schedule()
    for batch in plan.batches:
        record = scheduler.get(batch[0])
        assert record is not None
        scheduler.record_step_cost(record.batch_key, costs[str(record.batch_key)])
    finish_step(scheduler, plan)
    return plan.batches


def run_ticks(scheduler: Scheduler, costs: Mapping[str, float], ticks: int) -> list[list[str]]:
    """The ids stepped in each of `ticks` ticks, in order."""
    return [
        [rid for batch in step_charging(scheduler, costs) for rid in batch] for _ in range(ticks)
    ]


def test_a_new_key_steps_from_its_first_tick_and_a_gone_key_leaves() -> None:
    scheduler = Scheduler(max_running=3)
    start_running(scheduler, "a")
    scheduler.add_request(make_request("b"))
    plan = scheduler.schedule()
    assert plan.to_prepare == ["b"] and plan.batches == [["a"]]
    scheduler.mark_prepared("b", "other")
    finish_step(scheduler, plan)
    plan = scheduler.schedule()
    assert plan.batches == [["a"], ["b"]]
    finish_step(scheduler, plan, done={"a"})
    assert scheduler.schedule().batches == [["b"]]


def test_a_key_eight_times_cheaper_steps_eight_times_as_often() -> None:
    """Cost-aware turns: the cheap key steps every tick, the dear one every 8th; both get the
    same compute time, and the cheap one never waits for the dear one's step 7 ticks in 8."""
    scheduler = Scheduler(max_running=2)
    start_keyed(scheduler, {"small": "64", "large": "256"})
    ticks = run_ticks(scheduler, {"64": 1.0, "256": 8.0}, 80)
    both, small_only = ["small", "large"], ["small"]
    assert ticks == [both] + ([small_only] * 7 + [both]) * 9 + [small_only] * 7
    steps = Counter(rid for tick in ticks for rid in tick)
    assert steps == {"small": 80, "large": 10}
    assert steps["small"] * 1.0 == steps["large"] * 8.0  # equal shares of time


def test_three_keys_share_time_equally() -> None:
    scheduler = Scheduler(max_running=3)
    start_keyed(scheduler, {"a": "x", "b": "y", "c": "z"})
    costs = {"x": 1.0, "y": 2.0, "z": 4.0}
    ticks = run_ticks(scheduler, costs, 40)
    assert ticks[:4] == [["a", "b", "c"], ["a"], ["a", "b"], ["a"]]
    assert ticks[4:8] == [["a", "b", "c"], ["a"], ["a", "b"], ["a"]]  # a period of 4 ticks
    steps = Counter(rid for tick in ticks for rid in tick)
    assert steps == {"a": 40, "b": 20, "c": 10}
    time_used = {rid: steps[rid] * cost for rid, cost in zip("abc", costs.values(), strict=True)}
    assert time_used == dict.fromkeys("abc", 40.0)


def test_every_key_steps_within_the_bound_however_dear() -> None:
    """No starvation: a key 1000x dearer still steps once in every MAX_TICKS_WITHOUT_STEP."""
    scheduler = Scheduler(max_running=2)
    start_keyed(scheduler, {"cheap": "c", "dear": "d"})
    ticks = run_ticks(scheduler, {"c": 0.001, "d": 1.0}, 5 * MAX_TICKS_WITHOUT_STEP + 1)
    assert all("cheap" in tick for tick in ticks)
    dear_ticks = [i for i, tick in enumerate(ticks) if "dear" in tick]
    assert dear_ticks == list(range(0, len(ticks), MAX_TICKS_WITHOUT_STEP))


def test_every_key_steps_within_the_bound_whatever_the_costs() -> None:
    """The starvation bound, over step costs that change at random from tick to tick."""
    rng = random.Random(9)
    scheduler = Scheduler(max_running=4)
    start_keyed(scheduler, {"a": "w", "b": "x", "c": "y", "d": "z"})
    last_step = dict.fromkeys("abcd", -1)
    for tick in range(2000):
        costs = {key: rng.choice([1e-4, 1e-3, 0.05, 1.0, 30.0]) for key in "wxyz"}
        for rid in [rid for batch in step_charging(scheduler, costs) for rid in batch]:
            last_step[rid] = tick
        for rid, seen in last_step.items():
            assert tick - seen < MAX_TICKS_WITHOUT_STEP, f"{rid} not stepped since tick {seen}"


def test_a_key_that_appears_later_steps_in_its_first_tick() -> None:
    scheduler = Scheduler(max_running=3)
    start_keyed(scheduler, {"small": "64", "large": "256"})
    costs = {"64": 1.0, "128": 3.0, "256": 8.0}
    assert run_ticks(scheduler, costs, 2) == [["small", "large"], ["small"]]  # large owes 7
    scheduler.add_request(make_request("medium", total_steps=None))
    plan = scheduler.schedule()  # medium is prepared in this tick, stepped from the next
    assert plan.to_prepare == ["medium"] and plan.batches == [["small"]]
    scheduler.mark_prepared("medium", "128")
    finish_step(scheduler, plan)
    scheduler.record_step_cost("64", 1.0)
    ticks = run_ticks(scheduler, costs, 6)
    assert ticks[0] == ["small", "medium"]  # at once, ahead of the large key still owing
    assert ticks == [
        ["small", "medium"], ["small"], ["small"], ["small", "medium"], ["small"],
        ["small", "large"],  # large: 8 ticks after its last step, as without medium
    ]


def test_a_key_that_had_nothing_to_step_comes_back_owing_nothing() -> None:
    """Like a DRR queue that empties: a key with no runnable request leaves the turns."""
    scheduler = Scheduler(max_running=2)
    start_keyed(scheduler, {"small": "64", "large": "256"})
    costs = {"64": 1.0, "256": 8.0}
    assert run_ticks(scheduler, costs, 2) == [["small", "large"], ["small"]]
    plan = scheduler.schedule()
    assert plan.batches == [["small"]]
    scheduler.finish_requests("large", RequestState.FINISHED_ABORTED)
    scheduler.pop("large")
    finish_step(scheduler, plan)
    scheduler.add_request(make_request("large-2", total_steps=None))
    plan = scheduler.schedule()
    scheduler.mark_prepared("large-2", "256")
    finish_step(scheduler, plan)
    assert run_ticks(scheduler, costs, 1) == [["small", "large-2"]]


def test_one_key_steps_every_running_request_every_tick_whatever_its_costs() -> None:
    scheduler = Scheduler(max_running=5)
    start_keyed(scheduler, dict.fromkeys("abcde", "only"))
    for cost in [0.001, 5.0, 0.0, 30.0, 0.2, 0.2, 1e-7]:
        assert step_charging(scheduler, {"only": cost}) == [["a", "b", "c", "d", "e"]]


def test_keys_of_equal_cost_all_step_every_tick() -> None:
    scheduler = Scheduler(max_running=3)
    start_keyed(scheduler, {"a": "x", "b": "y", "c": "z"})
    assert run_ticks(scheduler, dict.fromkeys("xyz", 0.25), 10) == [["a", "b", "c"]] * 10


def test_every_step_call_of_a_key_in_a_tick_is_charged() -> None:
    """x's batch fails and is stepped again one request at a time: three calls, 2 s in all,
    so x steps twice for y's once, y costing 4 s."""
    scheduler = Scheduler(max_running=3)
    start_keyed(scheduler, {"a": "x", "b": "x", "c": "y"})
    ticks = []
    for _ in range(6):
        plan = scheduler.schedule()
        ticks.append(plan.batches)
        if ["a", "b"] in plan.batches:
            for seconds in (1.0, 0.5, 0.5):  # a and b together (raised), then each alone
                scheduler.record_step_cost("x", seconds)
        if ["c"] in plan.batches:
            scheduler.record_step_cost("y", 4.0)
        finish_step(scheduler, plan)
    assert ticks == [[["a", "b"], ["c"]], [["a", "b"]]] * 3


def test_urgency_orders_the_keys_of_a_tick() -> None:
    """The turns pick which keys step; within the tick, the key of the most urgent request
    goes first (not the key that came first), and urgency orders the requests within a key."""
    scheduler = Scheduler(max_running=4)
    keys = {"bulk-1": "x", "bulk-2": "x", "bulk-3": "y", "vip": "y"}
    start_keyed(scheduler, keys, priorities={"vip": -2, "bulk-2": -1})
    assert scheduler.schedule().batches == [["vip", "bulk-3"], ["bulk-2", "bulk-1"]]


def test_priority_still_preempts_across_keys() -> None:
    """The turns never step a preempted request, nor keep a more urgent one from its slot:
    a key that owes time still loses its run slot to a more urgent request of another key."""
    scheduler = Scheduler(max_running=2, max_batch=1)
    start_keyed(scheduler, {"low": "256"})
    assert run_ticks(scheduler, {"256": 8.0, "64": 1.0}, 1) == [["low"]]
    scheduler.add_request(make_request("high", total_steps=None, priority=-1))
    plan = scheduler.schedule()
    assert plan.preempted == ["low"] and plan.to_prepare == ["high"] and plan.batches == []
    scheduler.mark_prepared("high", "64")
    assert run_ticks(scheduler, {"256": 8.0, "64": 1.0}, 3) == [["high"]] * 3


def test_a_cost_for_a_key_not_in_the_turns_is_ignored() -> None:
    scheduler = Scheduler(max_running=1)
    start_keyed(scheduler, {"a": "x"})
    scheduler.record_step_cost("never-seen", 100.0)
    assert run_ticks(scheduler, {"x": 1.0}, 2) == [["a"], ["a"]]


# -- priorities and aging ----------------------------------------------------------------------


def test_aging_one_level_per_aging_period() -> None:
    clock = Clock()
    scheduler = Scheduler(max_running=1, clock=clock)
    start_running(scheduler, "running")
    scheduler.add_request(make_request("old", priority=3))
    clock.now += 3 * PRIORITY_AGING_SECONDS - 1  # not quite three levels older
    scheduler.add_request(make_request("fresh", priority=0))
    clock.now += 2  # three levels and a second older than "newest"
    scheduler.add_request(make_request("newest", priority=0))
    assert [scheduler.position(rid) for rid in ("fresh", "old", "newest")] == [0, 1, 2]


def test_aging_keeps_a_low_priority_request_from_starving() -> None:
    """Urgent requests arrive faster than they finish: the low-priority one still runs, right
    after the urgent ones submitted less than 5 aging periods (its 5 levels) after it."""
    clock = Clock()
    scheduler = Scheduler(max_running=1, clock=clock)
    start_running(scheduler, "urgent-0")
    scheduler.add_request(make_request("low", priority=5))
    admitted: list[str] = []
    for tick in range(1, 1000):
        clock.now += 1.0
        scheduler.add_request(make_request(f"urgent-{tick}", priority=0))
        plan = schedule_and_prepare(scheduler)
        admitted += plan.to_prepare
        if "low" in admitted:
            break
        finish_step(scheduler, plan, done=set(plan.scheduled_ids))
    levels_behind = int(5 * PRIORITY_AGING_SECONDS)  # seconds = ticks
    assert admitted == [*(f"urgent-{i}" for i in range(1, levels_behind)), "low"]
    assert scheduler.num_waiting > levels_behind  # later urgent ones wait behind it


def test_without_aging_pressure_priority_is_strict() -> None:
    scheduler = Scheduler(max_running=1)
    start_running(scheduler, "running")
    scheduler.add_request(make_request("low", priority=1))
    scheduler.add_request(make_request("high", priority=0))
    assert scheduler.position("high") == 0


# -- preemption --------------------------------------------------------------------------------


def test_a_more_urgent_arrival_preempts_the_least_urgent_running_one() -> None:
    scheduler = Scheduler(max_running=3, max_batch=2)
    for rid, priority in [("mid", 2), ("low", 5)]:
        scheduler.add_request(make_request(rid, priority=priority))
    schedule_and_prepare(scheduler)
    finish_step(scheduler, scheduler.schedule())

    scheduler.add_request(make_request("high", priority=0))
    plan = schedule_and_prepare(scheduler)
    assert plan.preempted == ["low"] and plan.to_prepare == ["high"]
    assert plan.batches == [["mid"]]  # high is stepped once prepared, from the next tick
    low = scheduler.get("low")
    assert low is not None and (low.state, low.step_index) == (RequestState.PREEMPTED, 1)
    assert (scheduler.num_running, scheduler.num_preempted, scheduler.num_holding) == (2, 1, 3)
    assert scheduler.num_waiting == 1 and scheduler.position("low") == 0

    plan = scheduler.schedule()
    assert plan.batches == [["high", "mid"]] and plan.preempted == [] and plan.resumed == []
    finish_step(scheduler, plan, done={"high"})
    plan = scheduler.schedule()  # high's slot frees: low resumes, with its state
    assert plan.resumed == ["low"] and plan.to_prepare == []
    assert plan.batches == [["mid", "low"]]
    assert (low.state, low.step_index) == (RequestState.RUNNING, 1)


def test_preemption_never_goes_over_max_running() -> None:
    scheduler = Scheduler(max_running=2, max_batch=1)
    start_running(scheduler, "low")
    scheduler.add_request(make_request("mid", priority=-1))
    assert schedule_and_prepare(scheduler).preempted == ["low"]
    scheduler.add_request(make_request("high", priority=-2))
    plan = schedule_and_prepare(scheduler)
    # high beats mid, but preempting mid would make three holders: high waits unprepared.
    assert plan.preempted == [] and plan.to_prepare == [] and plan.batches == [["mid"]]
    assert scheduler.num_holding == 2
    finish_step(scheduler, plan, done={"mid"})
    plan = schedule_and_prepare(scheduler)
    assert plan.to_prepare == ["high"] and plan.resumed == []  # high before low
    finish_step(scheduler, scheduler.schedule(), done={"high"})
    assert scheduler.schedule().resumed == ["low"]


def test_a_preempted_request_takes_a_free_run_slot_a_newcomer_cannot_take() -> None:
    """A more urgent newcomer that cannot get state (holders full) does not keep a preempted
    request, which already has state, from a free run slot."""
    scheduler = Scheduler(max_running=2, max_batch=2)
    start_running(scheduler, "a", "b")
    assert scheduler.preempt_request("b")
    scheduler.add_request(make_request("urgent", priority=-5))
    assert scheduler.position("urgent") == 0
    plan = scheduler.schedule()
    assert plan.resumed == ["b"] and plan.to_prepare == [] and plan.preempted == []
    assert plan.batches == [["a", "b"]] and scheduler.num_holding == 2


def test_equal_priorities_never_preempt_each_other() -> None:
    clock = Clock()
    scheduler = Scheduler(max_running=4, max_batch=1, clock=clock)
    start_running(scheduler, "first")
    clock.now += 100 * PRIORITY_AGING_SECONDS
    scheduler.add_request(make_request("later"))
    plan = scheduler.schedule()
    assert plan.preempted == [] and plan.batches == [["first"]]


def test_an_aged_request_is_not_preempted_by_a_newer_more_urgent_one() -> None:
    clock = Clock()
    scheduler = Scheduler(max_running=2, max_batch=1, clock=clock)
    start_running(scheduler, "old")  # priority 0
    clock.now += 2 * PRIORITY_AGING_SECONDS + 1
    scheduler.add_request(make_request("new", priority=-2))  # two levels better, but younger
    assert schedule_and_prepare(scheduler).preempted == []


def test_only_a_prepared_running_request_can_be_preempted() -> None:
    scheduler = Scheduler(max_running=2)
    scheduler.add_request(make_request("a"))
    scheduler.schedule()  # a is admitted but not prepared yet
    assert not scheduler.preempt_request("a")


def test_aborting_a_preempted_request_frees_its_holder_slot() -> None:
    scheduler = Scheduler(max_running=2, max_batch=1)
    start_running(scheduler, "low")
    scheduler.add_request(make_request("high", priority=-1))
    assert schedule_and_prepare(scheduler).preempted == ["low"]
    assert scheduler.finish_requests("low", RequestState.FINISHED_ABORTED) == {"low"}
    assert (scheduler.num_preempted, scheduler.num_waiting, scheduler.num_holding) == (0, 0, 1)
    assert state_of(scheduler, "low") is RequestState.FINISHED_ABORTED
    scheduler.add_request(make_request("next"))
    assert scheduler.schedule().to_prepare == []  # high still runs: one run slot
    assert scheduler.num_holding == 1


# -- batch forming (admission window) ------------------------------------------------------------


def test_a_lone_request_waits_for_the_window_and_no_longer() -> None:
    clock = Clock()
    scheduler = Scheduler(max_running=4, admission_window=0.005, clock=clock)
    scheduler.add_request(make_request("a"))
    plan = scheduler.schedule()
    assert plan.is_empty and plan.num_waiting == 1  # held: the engine may sleep ...
    assert scheduler.next_deadline() == pytest.approx(clock.now + 0.005)  # ... until then
    clock.now += 0.004
    assert scheduler.schedule().to_prepare == []
    clock.now += 0.001  # the window has passed: admitted however few came
    assert scheduler.schedule().to_prepare == ["a"]
    assert scheduler.next_deadline() is None


def test_a_burst_arriving_less_than_a_window_apart_starts_in_one_batch() -> None:
    clock = Clock()
    scheduler = Scheduler(max_running=8, admission_window=0.005, clock=clock)
    for rid in ("a", "b", "c"):  # spread over 8 ms, each within 5 ms of the one before
        scheduler.add_request(make_request(rid))
        assert schedule_and_prepare(scheduler).to_prepare == []
        clock.now += 0.004
    assert schedule_and_prepare(scheduler).to_prepare == []  # c came 4 ms ago
    clock.now += 0.001  # nobody for a window: the burst is complete
    assert schedule_and_prepare(scheduler).to_prepare == ["a", "b", "c"]
    assert scheduler.schedule().batches == [["a", "b", "c"]]


def test_a_batch_being_formed_is_admitted_by_the_forming_bound() -> None:
    clock = Clock()
    window = 0.005
    scheduler = Scheduler(max_running=100, admission_window=window, clock=clock)
    first = clock.now
    for n in range(100):  # one arrival every 4 ms, never a window's pause
        scheduler.add_request(make_request(f"r{n}"))
        if schedule_and_prepare(scheduler).to_prepare:
            break
        clock.now += 0.004
    assert clock.now - first == pytest.approx(MAX_FORMING_WINDOWS * window)
    assert scheduler.num_running == n + 1


def test_a_full_batch_is_admitted_at_once() -> None:
    scheduler = Scheduler(max_running=8, max_batch=3, admission_window=10.0)
    for rid in ("a", "b"):
        scheduler.add_request(make_request(rid))
    assert scheduler.schedule().to_prepare == []
    scheduler.add_request(make_request("c"))
    assert scheduler.schedule().to_prepare == ["a", "b", "c"]


def test_a_request_arriving_while_others_run_is_never_held() -> None:
    scheduler = Scheduler(max_running=4, admission_window=10.0)
    scheduler.add_request(make_request("a"))
    scheduler.add_request(make_request("b", priority=-1))
    scheduler.add_request(make_request("c"))
    scheduler.add_request(make_request("d"))  # a full batch: admitted at once
    schedule_and_prepare(scheduler)
    scheduler.finish_requests(["a", "b", "c"], RequestState.FINISHED_ABORTED)
    scheduler.add_request(make_request("late"))  # d still runs: late joins it now
    plan = schedule_and_prepare(scheduler)
    assert plan.to_prepare == ["late"] and plan.batches == [["d"]]
    assert scheduler.next_deadline() is None


def test_without_a_window_a_lone_request_is_admitted_at_once() -> None:
    scheduler = Scheduler(max_running=4)
    scheduler.add_request(make_request("a"))
    assert scheduler.schedule().to_prepare == ["a"]


def test_a_cancelled_request_stops_holding_the_others_back() -> None:
    clock = Clock()
    scheduler = Scheduler(max_running=4, admission_window=0.005, clock=clock)
    scheduler.add_request(make_request("old"))
    clock.now += 0.004
    scheduler.add_request(make_request("new"))
    assert scheduler.schedule().to_prepare == []
    scheduler.finish_requests("old", RequestState.FINISHED_ABORTED)
    clock.now += 0.002  # old's window is over, but new's runs from new's arrival
    assert scheduler.schedule().to_prepare == []
    assert scheduler.next_deadline() == pytest.approx(clock.now + 0.003)
