"""`stagemesh bench throughput`'s report: a paired round compares its burst with the peer image
and the ceiling probe measured just before it, and the report takes medians over rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.bench.throughput import Burst, Options, report

pytestmark = pytest.mark.unit

OPTIONS = Options(sizes=(128,), mixed_sizes=(), concurrency=(8,), steps=20, rounds=3,
                  loads=(), poisson_requests=0, out=Path("unused"))


def paired(wall: float, peer_s: float, ceiling_speedup: float, dit_step_s: float) -> Burst:
    return Burst(sizes=[128] * 8, latencies=[wall] * 8, wall=wall, dit_step_s=dit_step_s,
                 peer_s=peer_s, ceiling={"speedup": ceiling_speedup, "batched_s": 0.2})


def test_a_round_is_measured_against_its_own_peer_and_ceiling() -> None:
    # The machine slowed down by half in the second round: everything in it took 1.5x as long.
    fast, slow = paired(4.0, 1.0, 2.5, 0.18), paired(6.0, 1.5, 2.5, 0.27)
    assert fast.speedup == pytest.approx(2.0)  # 8 x 1.0 s serially against 4.0 s
    assert slow.speedup == pytest.approx(2.0)  # the drift cancels within a round
    assert fast.ceiling_share == pytest.approx(0.8)


def test_the_report_takes_the_median_round_not_a_phase_minutes_apart() -> None:
    rounds = [paired(4.0, 1.0, 2.5, 0.18), paired(6.0, 1.5, 2.5, 0.27),
              paired(4.0, 1.25, 2.5, 0.18)]
    # A peer phase measured on a faster stretch would make every burst look slow.
    result = report(OPTIONS, {128: 0.5}, {"bursts": {"128px c=8": rounds}, "staggered": {},
                                          "capacity_images_per_s": 2.0}, {})
    row = result["results"]["128px c=8"]
    assert row["speedup_over_peer_serial"] == pytest.approx(2.0)  # median of 2.0, 2.0, 2.5
    assert row["ceiling_share"] == pytest.approx(0.8)
    assert row["peer_serial_s"] == pytest.approx(8 * 1.25)
    assert row["dit_step_s"] == pytest.approx(0.18)
    assert [r["ceiling_share"] for r in row["rounds"]] == pytest.approx([0.8, 0.8, 1.0])
    assert "| 128px c=8 | 2.00 |" in result["table"]  # 8 images in the median wall, 4.0 s
    assert "80%" in result["table"] and "0.180 / 0.200" in result["table"]


def test_an_unpaired_burst_uses_the_peer_phase() -> None:
    mixed = Burst(sizes=[64, 128], latencies=[1.0, 2.0], wall=2.0)
    result = report(OPTIONS, {64: 0.5, 128: 1.5}, {"bursts": {"mixed c=2": [mixed]},
                                                   "staggered": {},
                                                   "capacity_images_per_s": 1.0}, {})
    row = result["results"]["mixed c=2"]
    assert row["peer_serial_s"] == pytest.approx(2.0)
    assert row["speedup_over_peer_serial"] == pytest.approx(1.0)
    assert row["ceiling_share"] is None
