"""When the codec decodes: the seed's async-chunk emission rule, as pure logic.

Frames reach the codec one at a time while the talker generates. Decoding each frame alone
would make seams audible, and waiting for the whole utterance costs time to first audio, so the
seed decodes in chunks:

* initial-chunk (IC) phase, while `n_frames <= chunk_frames` (`<=`, as in the seed): emit every
  `initial_chunk_frames` frames, so the first audio leaves early;
* normal phase: with `initial_coverage = (chunk_frames // initial_chunk_frames) *
  initial_chunk_frames`, emit when `(n_frames - initial_coverage) % chunk_frames == 0`;
* a finished request flushes whatever is left (in either phase).

`initial_chunks` limits the IC phase to that many initial chunks (the Piper decoder: one first
chunk of `initial_chunk_frames`, then `chunk_frames` each); unset, it is the seed's rule.

Each emission decodes its new frames with up to `left_context_frames` already-emitted frames in
front (`left_context_size = min(left_context_frames, frames emitted before)`), and the samples of
those context frames are trimmed from the output, so chunk seams match a one-shot decode.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Emission:
    """One chunk to decode: frames [start, end) of the request, the first `left_context_size`
    of them context only (decoded, then trimmed)."""

    left_context_size: int
    frames_in_payload: int  # left_context_size + new frames
    end: int  # frames emitted once this chunk is decoded

    @property
    def start(self) -> int:
        return self.end - self.frames_in_payload

    @property
    def new_frames(self) -> int:
        return self.frames_in_payload - self.left_context_size

    def as_tuple(self) -> tuple[int, int]:
        """The seed's test expectation `(left_context_size, payload_frames)`."""
        return (self.left_context_size, self.frames_in_payload)


@dataclass(frozen=True)
class ChunkRule:
    """The per-request emission rule. Stateless: everything follows from `n_frames`."""

    chunk_frames: int = 25
    initial_chunk_frames: int = 5
    left_context_frames: int = 25
    #: Initial chunks before the normal phase; None: while n_frames <= chunk_frames (the seed).
    initial_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {self.chunk_frames}")
        if self.initial_chunk_frames < 1:
            raise ValueError(f"initial_chunk_frames must be >= 1, got {self.initial_chunk_frames}")
        if self.left_context_frames < 0:
            raise ValueError(f"left_context_frames must be >= 0, got {self.left_context_frames}")
        if self.initial_chunks is not None and self.initial_chunks < 1:
            raise ValueError(f"initial_chunks must be >= 1, got {self.initial_chunks}")

    @property
    def initial_phase_end(self) -> int:
        """The last frame count that is still in the IC phase."""
        if self.initial_chunks is None:
            return self.chunk_frames
        return self.initial_chunks * self.initial_chunk_frames

    @property
    def initial_coverage(self) -> int:
        return (self.initial_phase_end // self.initial_chunk_frames) * self.initial_chunk_frames

    def is_boundary(self, n_frames: int) -> bool:
        """Does the rule emit when exactly `n_frames` frames have accumulated?"""
        if n_frames <= 0:
            return False
        if n_frames <= self.initial_phase_end:
            return n_frames % self.initial_chunk_frames == 0
        return (n_frames - self.initial_coverage) % self.chunk_frames == 0

    def next_boundary(self, emitted: int) -> int:
        """The first frame count past `emitted` at which the rule emits."""
        n_frames, initial, phase_end = max(emitted, 0) + 1, self.initial_chunk_frames, (
            self.initial_phase_end)
        if n_frames <= phase_end:
            boundary = -(-n_frames // initial) * initial
            if boundary <= phase_end:
                return boundary
            n_frames = phase_end + 1
        coverage = self.initial_coverage
        return coverage + -(-(n_frames - coverage) // self.chunk_frames) * self.chunk_frames

    def last_boundary_before(self, n_frames: int) -> int:
        """Frames emitted by the boundaries strictly before `n_frames` (0 if none)."""
        prev = n_frames - 1
        if prev <= 0:
            return 0
        phase_end = self.initial_phase_end
        initial_last = (min(prev, phase_end) // self.initial_chunk_frames) * (
            self.initial_chunk_frames
        )
        if prev <= phase_end:
            return initial_last
        coverage = self.initial_coverage
        normal_last = coverage + ((prev - coverage) // self.chunk_frames) * self.chunk_frames
        # normal-phase boundaries only exist past the IC phase
        return normal_last if normal_last > phase_end else initial_last

    def decide(self, n_frames: int, finished: bool) -> Emission | None:
        """The seed's rule at one call: emit now (and what), or hold (None)."""
        if n_frames <= 0 or not (finished or self.is_boundary(n_frames)):
            return None
        emitted = self.last_boundary_before(n_frames)
        return self.emission(emitted, n_frames)

    def next_emission(self, emitted: int, available: int, finished: bool) -> Emission | None:
        """The chunk after `emitted` frames once `available` frames can be decoded: up to the
        next boundary (even if a burst of frames jumped over it), or, once the request has
        finished, whatever is left; None: wait for frames."""
        end = self.next_boundary(emitted)
        if end <= available:
            return self.emission(emitted, end)
        if finished and available > emitted:
            return self.emission(emitted, available)
        return None

    def emission(self, emitted: int, end: int) -> Emission:
        """The chunk that takes a request from `emitted` to `end` frames."""
        context = min(self.left_context_frames, emitted)
        return Emission(
            left_context_size=context, frames_in_payload=context + end - emitted, end=end
        )


class ChunkTracker:
    """A request's position under a `ChunkRule` when frames may arrive several at a time.

    `next_emission` returns the first boundary past what was already emitted, even if frames
    arrived in a burst that jumped over it; called once per new frame it agrees with
    `ChunkRule.decide`.
    """

    def __init__(self, rule: ChunkRule) -> None:
        self.rule = rule
        self.emitted = 0

    def next_emission(self, available: int, finished: bool) -> Emission | None:
        emission = self.rule.next_emission(self.emitted, available, finished)
        if emission is not None:
            self.emitted = emission.end
        return emission
