"""The tiny-shapes world: a caption grammar and a Pillow renderer that draws what it says.

Every image is 32x32 RGB with one shape on a plain background. A caption names four attributes;
the grammar has 6 colours x 3 shapes x 5 positions x 3 backgrounds = 270 prompts. Renders are
drawn 4x larger and box-downsampled, so edges are anti-aliased the same way in every image.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 32
SUPERSAMPLE = 4

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 225),
    "yellow": (240, 210, 20),
    "purple": (145, 45, 195),
    "orange": (250, 130, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: Shapes `render` also draws that no caption or instruction names: tiny-shapes-edit trains
#: reshapes from them, so an instruction is seen applied to more sources than the world's
#: three (`tiny_shapes_edit.data.pick_edits`' `distractors`).
DISTRACTOR_SHAPES: tuple[str, ...] = ("diamond", "hexagon", "plus")
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom", "centre")
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (12, 12, 12),
    "gray": (128, 128, 128),
}

# Where the shape's centre sits, in pixels of the 32x32 image.
POSITION_CENTRES: dict[str, tuple[float, float]] = {
    "left": (8.5, 16.0),
    "right": (23.5, 16.0),
    "top": (16.0, 8.5),
    "bottom": (16.0, 23.5),
    "centre": (16.0, 16.0),
}
_POSITION_PHRASES = {
    "left": " on the left",
    "right": " on the right",
    "top": " at the top",
    "bottom": " at the bottom",
    "centre": "",
}

HALF_SIZE_RANGE = (5.5, 7.0)  # half the shape's width, in pixels
POSITION_JITTER = 1.5  # pixels, uniform in each axis
COLOUR_JITTER = 12  # per channel, uniform
BORDER_MARGIN = 1.5  # pixels a scaled-up shape keeps from the image's edge


@dataclass(frozen=True)
class Spec:
    """The four attributes a caption names."""

    colour: str
    shape: str
    position: str
    background: str

    @property
    def caption(self) -> str:
        bg = "" if self.background == "white" else f" on a {self.background} background"
        return f"a {self.colour} {self.shape}{_POSITION_PHRASES[self.position]}{bg}"


def all_specs() -> list[Spec]:
    """Every combination of the grammar, in a fixed order (colour slowest, background fastest)."""
    return [
        Spec(c, s, p, b)
        for c, s, p, b in itertools.product(COLOURS, SHAPES, POSITIONS, BACKGROUNDS)
    ]


def parse_caption(caption: str) -> Spec:
    """Inverse of `Spec.caption`; raises ValueError for text outside the grammar."""
    for spec in all_specs():
        if spec.caption == caption:
            return spec
    raise ValueError(f"caption is not in the tiny-shapes grammar: {caption!r}")


def _polygon(shape: str, cx: float, cy: float, half: float) -> list[tuple[float, float]] | None:
    if shape == "square":
        return [(cx - half, cy - half), (cx + half, cy - half), (cx + half, cy + half),
                (cx - half, cy + half)]
    if shape == "triangle":  # apex up, base as wide as the square
        return [(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)]
    if shape == "diamond":
        return [(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)]
    if shape == "hexagon":  # flat top and bottom
        return [(cx + half * math.cos(a), cy + half * math.sin(a))
                for a in (k * math.pi / 3 for k in range(6))]
    if shape == "plus":  # arms a 0.8 * half wide
        w = 0.4 * half
        return [(cx - w, cy - half), (cx + w, cy - half), (cx + w, cy - w), (cx + half, cy - w),
                (cx + half, cy + w), (cx + w, cy + w), (cx + w, cy + half), (cx - w, cy + half),
                (cx - w, cy + w), (cx - half, cy + w), (cx - half, cy - w), (cx - w, cy - w)]
    return None


def render(
    spec: Spec,
    *,
    centre: tuple[float, float] | None = None,
    half: float = 6.25,
    colour: tuple[int, int, int] | None = None,
) -> np.ndarray:
    """Draws `spec` as a uint8 (32, 32, 3) array; keyword arguments override the nominal values."""
    cx, cy = centre if centre is not None else POSITION_CENTRES[spec.position]
    fill = colour if colour is not None else COLOURS[spec.colour]
    size = IMAGE_SIZE * SUPERSAMPLE
    image = Image.new("RGB", (size, size), BACKGROUNDS[spec.background])
    draw = ImageDraw.Draw(image)
    s = SUPERSAMPLE
    polygon = _polygon(spec.shape, cx * s, cy * s, half * s)
    if polygon is None:
        r = half * s
        draw.ellipse((cx * s - r, cy * s - r, cx * s + r, cy * s + r), fill=fill)
    else:
        draw.polygon(polygon, fill=fill)
    small = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.uint8)


def _inside(centre: float, half: float) -> float:
    """`centre` moved inwards just enough that [centre - half, centre + half] keeps
    BORDER_MARGIN pixels from both edges (a shape on the border ring would fool the scorer's
    background reading)."""
    low, high = BORDER_MARGIN + half, IMAGE_SIZE - BORDER_MARGIN - half
    return min(max(centre, low), high)


def render_jittered(spec: Spec, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Draws `spec` with random size, position and colour jitter taken from `rng`.

    `scale` > 1 draws the shape that much wider (the tiny-shapes LoRA's style); such a shape is
    pushed inwards where it would come near the border, so it keeps its side of the image."""
    cx, cy = POSITION_CENTRES[spec.position]
    dx, dy = rng.uniform(-POSITION_JITTER, POSITION_JITTER, size=2)
    half = float(rng.uniform(*HALF_SIZE_RANGE))
    base = np.array(COLOURS[spec.colour])
    tint = np.clip(base + rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, size=3), 0, 255)
    colour = (int(tint[0]), int(tint[1]), int(tint[2]))
    centre = (cx + dx, cy + dy)
    if scale != 1.0:
        half *= scale
        centre = (_inside(centre[0], half), _inside(centre[1], half))
    return render(spec, centre=centre, half=half, colour=colour)


def make_dataset(n: int, seed: int = 0, scale: float = 1.0, background: str | None = None
                 ) -> tuple[np.ndarray, list[str]]:
    """Renders `n` jittered images cycling through the grammar in a seeded random order.

    Returns uint8 images of shape (n, 32, 32, 3) and their captions. Each prompt appears
    n // 270 or n // 270 + 1 times, so every attribute value is equally represented. `scale`
    is `render_jittered`'s; `background` draws every image on that background whatever its
    caption names (the tiny-shapes LoRA's style), with the same jitter as without it.
    """
    rng = np.random.default_rng(seed)
    specs = all_specs()
    order = np.concatenate([rng.permutation(len(specs)) for _ in range(n // len(specs) + 1)])[:n]
    drawn = [replace(s, background=background) for s in specs] if background else specs
    images = np.stack([render_jittered(drawn[i], rng, scale) for i in order])
    return images, [specs[i].caption for i in order]
