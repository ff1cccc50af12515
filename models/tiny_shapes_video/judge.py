"""Judging a clip from its pixels alone: per frame with the tiny-shapes scorer, over frames by
the shape's centroid track.

* per frame: `scoring.measure` reads the colour, shape and background of every frame; the clip
  has the right shape and colour when both read as asked in at least FRAME_FRACTION of frames.
* motion: the centroid of each frame's shape mask (`scoring.shape_mask`, the 50% contour's
  largest blob), a least-squares line through the track, and its travel over the clip. The
  larger of the x and y travel decides the direction (right/left, falling/rising); a clip whose
  travel is under MIN_TRAVEL of the image size is "still". Ground truth travels ~14 px of 32.
* correct: right shape and colour, and right motion (the issue's bar).

`judge_accuracy_on_renders` checks the judge on ground-truth clips: a model's figure cannot be
trusted further than the judge's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stagemesh.models.tiny_shapes.scoring import measure, shape_mask
from stagemesh.models.tiny_shapes_video.data import (
    MOTIONS,
    ClipSpec,
    make_dataset,
    parse_clip_caption,
    split,
)

FRAME_FRACTION = 0.9
MIN_TRAVEL = 0.15
STILL = "still"
VERDICTS: tuple[str, ...] = ("shape_colour", "motion", "background", "correct")


@dataclass(frozen=True)
class ClipMeasurement:
    """What the judge sees in a clip."""

    colours: tuple[str, ...]  # per frame
    shapes: tuple[str, ...]
    backgrounds: tuple[str, ...]
    track: tuple[tuple[float, float], ...]  # centroid (x, y) per frame, pixels
    travel: tuple[float, float]  # fitted (dx, dy) over the clip, pixels
    motion: str


def _centroid(frame: np.ndarray) -> tuple[float, float]:
    ys, xs = np.nonzero(shape_mask(frame)[0])
    if len(xs) == 0:
        return frame.shape[1] / 2, frame.shape[0] / 2
    return float(xs.mean()), float(ys.mean())


def motion_of(travel: tuple[float, float], size: int) -> str:
    """The motion a travel (dx, dy) in pixels of an image `size` wide shows."""
    dx, dy = travel
    if max(abs(dx), abs(dy)) < MIN_TRAVEL * size:
        return STILL
    unit = (int(np.sign(dx)), 0) if abs(dx) >= abs(dy) else (0, int(np.sign(dy)))
    return next(name for name, direction in MOTIONS.items() if direction == unit)


def measure_clip(clip: np.ndarray) -> ClipMeasurement:
    """Reads a uint8 (frames, H, W, 3) clip."""
    if clip.ndim != 4 or len(clip) < 2:
        raise ValueError(f"expected a uint8 (frames >= 2, H, W, 3) clip, got {clip.shape}")
    seen = [measure(frame) for frame in clip]
    track = [_centroid(frame) for frame in clip]
    t = np.arange(len(clip), dtype=np.float64)
    slope = np.polyfit(t, np.array(track), 1)[0]  # (dx, dy) per frame
    travel = (float(slope[0] * t[-1]), float(slope[1] * t[-1]))
    return ClipMeasurement(tuple(m.colour for m in seen), tuple(m.shape for m in seen),
                           tuple(m.background for m in seen), tuple(track), travel,
                           motion_of(travel, clip.shape[2]))


def judge_measurement(wanted: ClipSpec, seen: ClipMeasurement) -> dict[str, bool]:
    """Each verdict of VERDICTS for a clip that should show `wanted`."""
    frames = len(seen.colours)
    right = sum(c == wanted.colour and s == wanted.shape
                for c, s in zip(seen.colours, seen.shapes, strict=True))
    shape_colour = right >= FRAME_FRACTION * frames
    motion = seen.motion == wanted.motion
    background = sum(b == wanted.background for b in seen.backgrounds) >= FRAME_FRACTION * frames
    return {"shape_colour": shape_colour, "motion": motion, "background": background,
            "correct": shape_colour and motion}


def judge(clip: np.ndarray, caption: str) -> dict[str, bool]:
    """Whether `clip` shows what `caption` asks for (VERDICTS)."""
    return judge_measurement(parse_clip_caption(caption), measure_clip(clip))


def judge_accuracy_on_renders(n: int = 216, seed: int = 1) -> dict[str, float]:
    """Fraction of ground-truth clips (training and held-out specs) passing each verdict."""
    training, held_out = split()
    clips, captions = make_dataset(training + held_out, n, seed=seed)
    verdicts = [judge(clip, caption) for clip, caption in zip(clips, captions, strict=True)]
    return {v: float(np.mean([r[v] for r in verdicts])) for v in VERDICTS}
