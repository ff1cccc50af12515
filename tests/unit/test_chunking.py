"""The async-chunk emission rule: the seed's case table, plus bursty input and coverage."""

from __future__ import annotations

import pytest

from stagemesh.services.codec.chunking import ChunkRule, ChunkTracker

# (chunk_frames, left_context_frames, initial_chunk_frames), n_frames, finished,
# expected (left_context_size, payload_frames) or None (hold) -- the seed's _CASES.
CASES = [
    # IC=16 (the seed's dynamic IC at that load), cs=25: initial_coverage=16 < cs
    ((25, 25, 16), 24, False, None),
    ((25, 25, 16), 25, False, None),
    ((25, 25, 16), 41, False, (16, 41)),
    # IC=10, cs=25: initial_coverage=20; frames 21..25 are still IC phase and hold
    ((25, 25, 10), 9, False, None),
    ((25, 25, 10), 10, False, (0, 10)),
    ((25, 25, 10), 25, False, None),
    ((25, 25, 10), 45, False, (20, 45)),
    ((25, 25, 10), 5, True, (0, 5)),
    ((25, 25, 10), 33, True, (20, 33)),
    # IC=8, cs=16: IC divides cs, the IC phase fills the first chunk (emits at 8 and 16)
    ((16, 25, 8), 8, False, (0, 8)),
    ((16, 25, 8), 16, False, (8, 16)),
    ((16, 25, 8), 24, False, None),
    ((16, 25, 8), 32, False, (16, 32)),
    # IC=5, cs=25: emits at 5, 10, 15, 20, 25, then every 25
    ((25, 25, 5), 5, False, (0, 5)),
    ((25, 25, 5), 12, False, None),
    ((25, 25, 5), 25, False, (20, 25)),
    ((25, 25, 5), 30, False, None),
    ((25, 25, 5), 50, False, (25, 50)),
    # per-request IC=15 at 10 frames: 10 % 15 != 0
    ((25, 25, 15), 10, False, None),
]


def _rule(params: tuple[int, int, int]) -> ChunkRule:
    chunk, context, initial = params
    return ChunkRule(chunk_frames=chunk, initial_chunk_frames=initial, left_context_frames=context)


@pytest.mark.parametrize(("params", "n_frames", "finished", "expected"), CASES)
def test_seed_cases(
    params: tuple[int, int, int], n_frames: int, finished: bool, expected: tuple[int, int] | None
) -> None:
    emission = _rule(params).decide(n_frames, finished)
    assert (emission.as_tuple() if emission else None) == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ((25, 25, 10), 20),
        ((25, 25, 16), 16),
        ((16, 25, 8), 16),
        ((25, 25, 5), 25),
        ((25, 25, 2), 24),
    ],
)
def test_initial_coverage(params: tuple[int, int, int], expected: int) -> None:
    assert _rule(params).initial_coverage == expected


def test_ic_phase_uses_less_or_equal() -> None:
    # With IC > cs, initial_coverage is 0: at n == cs the IC phase (<=) holds (10 % 15 != 0),
    # where a strict < would already be in the normal phase and emit ((10 - 0) % 10 == 0).
    rule = ChunkRule(chunk_frames=10, initial_chunk_frames=15, left_context_frames=25)
    assert rule.initial_coverage == 0
    assert rule.decide(10, finished=False) is None
    emission = rule.decide(20, finished=False)
    assert emission is not None and emission.as_tuple() == (0, 20)


def test_left_context_is_capped_by_setting() -> None:
    rule = ChunkRule(chunk_frames=10, initial_chunk_frames=5, left_context_frames=3)
    emission = rule.decide(30, finished=False)
    assert emission is not None and emission.as_tuple() == (3, 13)
    assert emission.start == 17 and emission.end == 30


def _emissions(rule: ChunkRule, arrivals: list[int], total: int) -> list[tuple[int, int, int]]:
    """Feed `total` frames in bursts of the given sizes, stepping until nothing is due."""
    tracker = ChunkTracker(rule)
    out, available = [], 0
    for size in arrivals:
        available = min(total, available + size)
        finished = available == total
        # every emission moves past at least one new frame, so `available` calls are enough
        for _ in range(available + 1):
            emission = tracker.next_emission(available, finished)
            if emission is None:
                break
            out.append((emission.start, emission.left_context_size, emission.end))
        else:
            pytest.fail(f"the tracker kept emitting with {available} frames available")
        if finished:
            break
    return out


@pytest.mark.parametrize("params", [(25, 25, 5), (25, 25, 10), (16, 25, 8), (25, 25, 16)])
def test_tracker_agrees_with_rule_frame_by_frame(params: tuple[int, int, int]) -> None:
    rule, total = _rule(params), 83
    expected = []
    for n in range(1, total + 1):
        emission = rule.decide(n, finished=n == total)
        if emission is not None:
            expected.append((emission.start, emission.left_context_size, emission.end))
    assert _emissions(rule, [1] * total, total) == expected


@pytest.mark.parametrize("burst", [3, 7, 25, 100])
def test_bursts_emit_every_boundary_and_cover_each_frame_once(burst: int) -> None:
    rule = ChunkRule(chunk_frames=25, initial_chunk_frames=5, left_context_frames=25)
    total = 83
    emissions = _emissions(rule, [burst] * total, total)
    ends = [end for _, _, end in emissions]
    assert ends == [5, 10, 15, 20, 25, 50, 75, 83]
    new_ranges = [(start + context, end) for start, context, end in emissions]
    assert [lo for lo, _ in new_ranges] == [0, *ends[:-1]]


def test_finished_with_nothing_new_emits_nothing() -> None:
    tracker = ChunkTracker(ChunkRule(chunk_frames=25, initial_chunk_frames=5))
    assert tracker.next_emission(5, finished=False) is not None
    assert tracker.next_emission(5, finished=True) is None


@pytest.mark.parametrize(
    "kwargs",
    [{"chunk_frames": 0}, {"initial_chunk_frames": 0}, {"left_context_frames": -1}],
)
def test_invalid_rule(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ChunkRule(**kwargs)


@pytest.mark.parametrize("chunk", [1, 4, 10, 16, 25])
@pytest.mark.parametrize("initial", [1, 2, 5, 8, 15, 30])
def test_last_boundary_matches_brute_force(chunk: int, initial: int) -> None:
    rule = ChunkRule(chunk_frames=chunk, initial_chunk_frames=initial)
    for n in range(1, 120):
        boundaries = [m for m in range(1, n) if rule.is_boundary(m)]
        assert rule.last_boundary_before(n) == (boundaries[-1] if boundaries else 0), n


@pytest.mark.parametrize("initial_chunks", [None, 1, 2, 3])
@pytest.mark.parametrize("chunk", [1, 4, 16, 25, 48])
@pytest.mark.parametrize("initial", [1, 5, 8, 16, 30])
def test_next_and_last_boundary_match_brute_force(
    chunk: int, initial: int, initial_chunks: int | None
) -> None:
    rule = ChunkRule(chunk_frames=chunk, initial_chunk_frames=initial,
                     initial_chunks=initial_chunks)
    boundaries = [n for n in range(1, 400) if rule.is_boundary(n)]
    for emitted in range(0, 200):
        assert rule.next_boundary(emitted) == next(b for b in boundaries if b > emitted), emitted
        before = [b for b in boundaries if b < emitted]
        assert rule.last_boundary_before(emitted) == (before[-1] if before else 0), emitted


def test_one_initial_chunk_then_full_chunks() -> None:
    """The Piper decoder's rule: a first chunk of initial_chunk_frames, then chunk_frames."""
    rule = ChunkRule(chunk_frames=48, initial_chunk_frames=16, left_context_frames=12,
                     initial_chunks=1)
    ends = [end for _, _, end in _emissions(rule, [1] * 130, 130)]
    assert ends == [16, 64, 112, 130]
    with pytest.raises(ValueError, match="initial_chunks"):
        ChunkRule(initial_chunks=0)
