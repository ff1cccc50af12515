"""The simulator core of `stagemesh bench scale` (bench/scale.py) on small, hand-checked traces:
no model, no server."""

from __future__ import annotations

import pytest

from stagemesh.bench.scale import (
    STAGES,
    Policy,
    Request,
    StageCosts,
    TraceSpec,
    make_trace,
    simulate,
    visits,
)

#: One second per prompt, per denoise step, per decode, per frame, per chunk of 2 frames.
COSTS = StageCosts(tokenizer_s=1.0, dit_step_s={32: 1.0}, vae_s={32: 1.0},
                   talker_frame_s=1.0, codec_chunk_s=1.0, chunk_frames=2)


def image(arrival: float, cancel_after: int | None = None) -> Request:
    return Request(arrival, "image", units=2, size=32, cancel_after=cancel_after)


def speech(arrival: float, frames: int = 4) -> Request:
    return Request(arrival, "speech", units=frames)


def static(replicas: int, per_stage: bool = True) -> Policy:
    """No autoscaling: the minimum is the maximum."""
    return Policy(per_stage, 1.0, dict.fromkeys(STAGES, replicas), max_replicas=replicas)


def test_a_request_alone_takes_its_service_time_and_holds_one_replica_per_stage() -> None:
    outcome = simulate([image(0.0)], COSTS, static(1))
    assert outcome.latencies["image"] == [4.0]  # tokenizer 1 + 2 steps + decode 1
    assert outcome.replica_seconds == dict.fromkeys(STAGES, 4.0)
    assert outcome.accelerator_seconds == 16.0  # the codec holds no accelerator


def test_queueing_delay_appears_when_capacity_is_short() -> None:
    two = [image(0.0), image(0.0)]
    # One replica per stage: the second prompt waits 1 s for the tokenizer, then 1 s more
    # for the DiT (whose first request runs until t=3), and finishes at 6.
    assert sorted(simulate(two, COSTS, static(1)).latencies["image"]) == [4.0, 6.0]
    assert simulate(two, COSTS, static(2)).latencies["image"] == [4.0, 4.0]


def test_a_cancelled_request_stops_at_its_step_and_never_reaches_the_vae() -> None:
    assert [stage for stage, _ in visits(image(0.0, cancel_after=1), COSTS)] == \
        ["tokenizer", "dit"]
    # It holds the DiT for its one step, then the next request gets it.
    outcome = simulate([image(0.0, cancel_after=1), image(0.0)], COSTS, static(1))
    assert outcome.latencies["image"] == [5.0]  # waits 1 s (tokenizer), 1 s (one DiT step)
    assert outcome.waits["vae"] == [0.0]


def test_speech_goes_through_the_talker_then_the_codec_by_chunks() -> None:
    assert visits(speech(0.0, frames=3), COSTS) == [("talker", 3.0), ("codec", 2.0)]


def _burst_of_speech() -> list[Request]:
    return [speech(float(t)) for t in range(0, 40, 2) for _ in range(3)]


def test_per_stage_scaling_adds_only_the_stage_under_load() -> None:
    trace = _burst_of_speech()
    policy = Policy(True, 1.0, dict.fromkeys(STAGES, 1), start_lag_s=5.0, poll_s=2.0)
    per_stage = simulate(trace, COSTS, policy)
    whole = simulate(trace, COSTS, Policy(False, 1.0, dict.fromkeys(STAGES, 1),
                                          start_lag_s=5.0, poll_s=2.0))
    # Images never come: per-stage scaling keeps one idle replica of each image stage for the
    # whole run; whole-pipeline replicas bring idle image stages along with every talker.
    for stage in ("tokenizer", "dit", "vae"):
        assert per_stage.peak_replicas[stage] == 1
        assert per_stage.replica_seconds[stage] == pytest.approx(per_stage.seconds)
        assert whole.peak_replicas[stage] == whole.peak_replicas["talker"] > 1
    assert per_stage.peak_replicas["talker"] > 1
    assert per_stage.accelerator_seconds < whole.accelerator_seconds


def test_a_replica_serves_only_after_its_start_lag_but_costs_from_the_ask() -> None:
    trace = _burst_of_speech()
    never_ready = Policy(True, 1.0, dict.fromkeys(STAGES, 1), start_lag_s=10_000.0, poll_s=2.0)
    lagged = simulate(trace, COSTS, never_ready)
    alone = simulate(trace, COSTS, static(1))
    assert lagged.latencies == alone.latencies  # the new replicas never served anything
    assert lagged.peak_replicas["talker"] > 1
    assert lagged.replica_seconds["talker"] > alone.replica_seconds["talker"]


def test_replicas_go_back_down_after_the_window() -> None:
    trace = [*_burst_of_speech(), speech(1000.0)]
    policy = Policy(True, 1.0, dict.fromkeys(STAGES, 1), start_lag_s=1.0, poll_s=2.0,
                    scale_down_window_s=20.0)
    outcome = simulate(trace, COSTS, policy)
    peak = outcome.peak_replicas["talker"]
    assert peak > 1
    # Held at the peak for the whole run, the talker would cost peak x run length.
    assert outcome.replica_seconds["talker"] < 0.2 * peak * outcome.seconds


def test_the_trace_mixes_sizes_tasks_and_cancellations_reproducibly() -> None:
    costs = StageCosts(0.01, {32: 0.01, 64: 0.02}, {32: 0.01, 64: 0.02}, 0.01, 0.02, 25)
    trace = make_trace(TraceSpec(load=2.0, seed=7), costs)
    assert trace == make_trace(TraceSpec(load=2.0, seed=7), costs)
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)
    assert {r.size for r in trace if r.task == "image"} == {32, 64}
    assert {r.task for r in trace} == {"image", "speech"}
    cancelled = sum(r.cancel_after is not None for r in trace) / len(trace)
    assert 0.25 < cancelled < 0.35
    assert all(0 <= r.cancel_after < r.units for r in trace if r.cancel_after is not None)
