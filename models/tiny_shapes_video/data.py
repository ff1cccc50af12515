"""Clips of the tiny-shapes world: one shape of one colour sliding across a plain background.

A caption names four attributes, "a red circle moving right on a black background": 6 colours x
3 shapes x 4 motions x 3 backgrounds = 216 prompts. A clip is NUM_FRAMES frames of 32x32, drawn
with tiny-shapes' renderer (`tiny_shapes.data.render`), the shape's centre moving at constant
speed from one side to the other along the motion's axis (start and end jittered), through the
middle across it (`CROSS_RANGE`); size and colour tint are jittered once per clip.

Held out: 20% of the (colour, shape, motion) combinations, chosen by a fixed seed, in every
background; training never sees them, the evaluation asks only for them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from stagemesh.models.tiny_shapes.data import (
    BACKGROUNDS,
    COLOUR_JITTER,
    COLOURS,
    HALF_SIZE_RANGE,
    IMAGE_SIZE,
    SHAPES,
    Spec,
    render,
)

NUM_FRAMES = 9
#: Prompt tokens the text encoder reads, in training and when served (the recipe's tokenizer
#: `max_sequence_length`; the stock `WanPipeline`'s `max_sequence_length`): the longest caption
#: is 11 tokens. Wan's default, 512 zero-padded tokens, made the text ~75% of a training step.
PROMPT_TOKENS = 32
#: Motion -> unit direction (x, y) in image coordinates (y grows downwards).
MOTIONS: dict[str, tuple[int, int]] = {
    "moving right": (1, 0),
    "moving left": (-1, 0),
    "falling": (0, 1),
    "rising": (0, -1),
}
#: Along the motion's axis the centre travels between these (before jitter), in pixels of 32.
TRAVEL = (9.0, 23.0)
TRAVEL_JITTER = 0.75
#: Across the axis the centre sits uniformly this far from the middle, in pixels of 32. The
#: caption does not name it, so a model spreads the shape over the range: at 4 rising squares
#: came out as wide bands; at 5250 steps held-out squares were 9 of 18 at 2 and 14 of 18 at 0
#: (the path across the middle: the caption then leaves nothing about the place open).
CROSS_RANGE = 0.0
HELD_OUT_FRACTION = 0.2
SPLIT_SEED = 27


@dataclass(frozen=True)
class ClipSpec:
    """The four attributes a video caption names."""

    colour: str
    shape: str
    motion: str
    background: str

    @property
    def caption(self) -> str:
        bg = "" if self.background == "white" else f" on a {self.background} background"
        return f"a {self.colour} {self.shape} {self.motion}{bg}"

    @property
    def combination(self) -> tuple[str, str, str]:
        """(colour, shape, motion): the unit of the held-out split."""
        return self.colour, self.shape, self.motion

    @property
    def still(self) -> Spec:
        """The tiny-shapes spec of one frame (its position is set per frame)."""
        return Spec(self.colour, self.shape, "centre", self.background)


def all_clip_specs() -> list[ClipSpec]:
    """Every combination, in a fixed order (colour slowest, background fastest)."""
    return [ClipSpec(c, s, m, b)
            for c, s, m, b in itertools.product(COLOURS, SHAPES, MOTIONS, BACKGROUNDS)]


def all_captions() -> list[str]:
    return [spec.caption for spec in all_clip_specs()]


def parse_clip_caption(caption: str) -> ClipSpec:
    """Inverse of `ClipSpec.caption`; raises ValueError for text outside the grammar."""
    for spec in all_clip_specs():
        if spec.caption == caption:
            return spec
    raise ValueError(f"caption is not in the tiny-shapes-video grammar: {caption!r}")


def held_out_combinations() -> frozenset[tuple[str, str, str]]:
    """20% of the (colour, shape, motion) combinations, fixed by SPLIT_SEED."""
    triples = list(itertools.product(COLOURS, SHAPES, MOTIONS))
    n = round(HELD_OUT_FRACTION * len(triples))
    rng = np.random.default_rng(SPLIT_SEED)
    return frozenset(triples[i] for i in rng.choice(len(triples), size=n, replace=False))


def split() -> tuple[list[ClipSpec], list[ClipSpec]]:
    """(training specs, held-out specs)."""
    held = held_out_combinations()
    specs = all_clip_specs()
    return ([s for s in specs if s.combination not in held],
            [s for s in specs if s.combination in held])


def centres(motion: str, rng: np.random.Generator, frames: int = NUM_FRAMES,
            cross_range: float = CROSS_RANGE) -> list[tuple[float, float]]:
    """The shape's centre in each frame: constant speed along the motion's axis, uniformly
    within `cross_range` pixels of the middle across it."""
    dx, dy = MOTIONS[motion]
    start, end = np.array(TRAVEL) + rng.uniform(-TRAVEL_JITTER, TRAVEL_JITTER, size=2)
    if dx + dy < 0:
        start, end = end, start
    middle = IMAGE_SIZE / 2
    across = middle + float(rng.uniform(-cross_range, cross_range))
    path = np.linspace(start, end, frames)
    return [(float(a), across) if dx else (across, float(a)) for a in path]


def render_clip(spec: ClipSpec, rng: np.random.Generator, frames: int = NUM_FRAMES,
                cross_range: float = CROSS_RANGE) -> np.ndarray:
    """A uint8 (frames, 32, 32, 3) clip of `spec` with one draw of jitter from `rng`."""
    path = centres(spec.motion, rng, frames, cross_range)
    half = float(rng.uniform(*HALF_SIZE_RANGE))
    tint = np.clip(np.array(COLOURS[spec.colour]) + rng.integers(-COLOUR_JITTER,
                                                                 COLOUR_JITTER + 1, size=3), 0, 255)
    colour = (int(tint[0]), int(tint[1]), int(tint[2]))
    return np.stack([render(spec.still, centre=c, half=half, colour=colour) for c in path])


def make_dataset(specs: list[ClipSpec], n: int, seed: int = 0, *,
                 cross_range: float = CROSS_RANGE) -> tuple[np.ndarray, list[str]]:
    """`n` clips cycling through `specs` in a seeded order: uint8 (n, frames, 32, 32, 3) and
    their captions. Each spec appears n // len(specs) or one more times."""
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(specs))
                            for _ in range(n // len(specs) + 1)])[:n]
    clips = np.stack([render_clip(specs[i], rng, cross_range=cross_range) for i in order])
    return clips, [specs[i].caption for i in order]
