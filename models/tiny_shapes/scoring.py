"""Measuring what a tiny-shapes image shows, from its pixels alone.

All functions take a uint8 RGB array of shape (H, W, 3) (any size; the grammar's geometry is
scaled to it) and are pure. `measure(image)` returns the four attributes it sees;
`score(image, caption)` compares them with what the caption asked for.

How each attribute is measured:

* background: the median colour of the one-pixel border ring, assigned to the nearest palette
  background (white / black / gray) by Euclidean RGB distance. The shape never touches the
  border in the grammar, so the ring is pure background.
* shape pixels: every pixel's RGB distance from that measured background colour. The *core*
  pixels are those at least 60% as far from the background as the farthest pixel; the shape
  *mask* is every pixel at least half as far as the core's median colour - the 50% contour, which
  keeps the true area of an anti-aliased or slightly blurred shape.
* colour: the median of the core pixels, assigned to the nearest palette colour. Using the core
  keeps blurred edges (mixtures with the background) out of the estimate.
* position: the centre of the mask's bounding box relative to the image centre, in units of the
  image size (the box, not the centroid: a triangle's centroid sits a sixth of its height below
  its nominal centre). If neither offset exceeds 0.1 (3.2 px of 32) it is "centre"; otherwise
  the larger offset decides left / right (x) or top / bottom (y).
* shape: three numbers from the mask's bounding box. `fill` = mask area / box area is 1 for a
  square, pi/4 ~ 0.79 for a circle and ~0.5 for the grammar's apex-up triangle. `corners` = the
  mean of the mask over the box's four 2x2 corner blocks is ~1 for a square and ~0 for a circle
  (a small digital disk can fill 90% of its box, but never its corners). `taper` = the mask's
  width over the top third of the box divided by its width over the bottom third is ~1 for a
  square or circle and ~0.45 for a triangle. A triangle is called when taper < 0.7 or
  fill < 0.62; otherwise square when fill + 0.3 * corners >= 1, else circle. The largest
  4-connected blob of the mask is used, so stray specks do not move the box.

`scorer_accuracy_on_renders()` checks these rules on jittered ground-truth renders; an
attribute whose scorer is wrong on real renders would make its accuracy figure meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stagemesh.models.tiny_shapes.data import BACKGROUNDS, COLOURS, Spec, parse_caption

CORE_FRACTION = 0.6
MASK_FRACTION = 0.5
CENTRE_TOLERANCE = 0.1
TRIANGLE_TAPER = 0.7
TRIANGLE_FILL = 0.62
SQUARE_SCORE = 1.0
CORNER_WEIGHT = 0.3
ATTRIBUTES: tuple[str, ...] = ("colour", "shape", "position", "background")
METHODS: dict[str, str] = {
    "background": "median RGB of the one-pixel border ring -> nearest palette background",
    "colour": "median RGB of the core pixels (>= 60% of the largest distance from the "
              "background) -> nearest palette colour",
    "position": "centre of the shape mask's bounding box (mask: pixels at least half as far from "
                "the background as the shape colour, largest blob) vs the image centre; centre "
                "if both offsets <= 10% of the size, else the larger offset's direction",
    "shape": "bounding box of the mask: triangle if top-third width / bottom-third width < 0.7 "
             "or fill (mask area / box area) < 0.62; else square if fill + 0.3 * corners (mask "
             "mean over the box's 2x2 corner blocks) >= 1; else circle",
}


@dataclass(frozen=True)
class Measurement:
    """What the scorer sees in one image, plus the raw numbers behind the shape call."""

    colour: str
    shape: str
    position: str
    background: str
    fill: float
    corners: float
    taper: float

    def as_spec(self) -> Spec:
        return Spec(self.colour, self.shape, self.position, self.background)


def _nearest(rgb: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    names = list(palette)
    distances = [float(np.linalg.norm(rgb - np.array(palette[n], dtype=np.float64))) for n in names]
    return names[int(np.argmin(distances))]


def background_colour(image: np.ndarray) -> np.ndarray:
    """Median RGB of the one-pixel border ring, as float64 (3,)."""
    ring = np.concatenate([image[0], image[-1], image[1:-1, 0], image[1:-1, -1]])
    return np.median(ring.astype(np.float64), axis=0)


def _distance_map(image: np.ndarray, background: np.ndarray) -> np.ndarray:
    distances: np.ndarray = np.linalg.norm(image.astype(np.float64) - background, axis=-1)
    return distances


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (the mask itself if it is empty)."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    best_label, best_size, label = 0, 0, 0
    for start in zip(*np.nonzero(mask), strict=True):
        if labels[start]:
            continue
        label += 1
        labels[start] = label
        stack, size = [start], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                inside = 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1]
                if inside and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = label
                    stack.append((ny, nx))
        if size > best_size:
            best_label, best_size = label, size
    return labels == best_label if best_label else mask


def shape_mask(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (mask of shape pixels, core mask) as boolean (H, W) arrays."""
    distance = _distance_map(image, background_colour(image))
    core = distance >= CORE_FRACTION * distance.max()
    if distance.max() <= 0:
        return np.zeros_like(core), np.zeros_like(core)
    object_colour = np.median(image[core].astype(np.float64), axis=0)
    contrast = float(np.linalg.norm(object_colour - background_colour(image)))
    mask = _largest_component(distance >= MASK_FRACTION * contrast)
    return mask, core


def _position(mask: np.ndarray) -> str:
    h, w = mask.shape
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return "centre"
    dx = (xs.min() + xs.max() + 1) / (2 * w) - 0.5
    dy = (ys.min() + ys.max() + 1) / (2 * h) - 0.5
    if max(abs(dx), abs(dy)) <= CENTRE_TOLERANCE:
        return "centre"
    if abs(dx) >= abs(dy):
        return "left" if dx < 0 else "right"
    return "top" if dy < 0 else "bottom"


def _shape_numbers(mask: np.ndarray) -> tuple[float, float, float]:
    """(fill, corners, taper) of the mask's bounding box; (0, 0, 1) for an empty mask."""
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return 0.0, 0.0, 1.0
    box = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].astype(np.float64)
    fill = float(box.mean())
    corners = float(np.mean([box[:2, :2].mean(), box[:2, -2:].mean(), box[-2:, :2].mean(),
                             box[-2:, -2:].mean()]))
    third = max(1, box.shape[0] // 3)
    top_width = box[:third].sum(axis=1).mean()
    bottom_width = box[-third:].sum(axis=1).mean()
    return fill, corners, float(top_width / max(bottom_width, 1e-6))


def _shape(fill: float, corners: float, taper: float) -> str:
    if taper < TRIANGLE_TAPER or fill < TRIANGLE_FILL:
        return "triangle"
    return "square" if fill + CORNER_WEIGHT * corners >= SQUARE_SCORE else "circle"


def measure(image: np.ndarray) -> Measurement:
    """Reads colour, shape, position and background off a uint8 RGB (H, W, 3) image."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 (H, W, 3) array, got {image.dtype} {image.shape}")
    background = _nearest(background_colour(image), BACKGROUNDS)
    mask, core = shape_mask(image)
    colour = _nearest(np.median(image[core].astype(np.float64), axis=0), COLOURS) if core.any() \
        else background
    fill, corners, taper = _shape_numbers(mask)
    shape = _shape(fill, corners, taper)
    return Measurement(colour, shape, _position(mask), background, fill, corners, taper)


def score(image: np.ndarray, caption: str) -> dict[str, bool]:
    """For each attribute, whether the image shows what `caption` asks for."""
    wanted = parse_caption(caption)
    seen = measure(image)
    return {name: getattr(seen, name) == getattr(wanted, name) for name in ATTRIBUTES}


def scorer_accuracy_on_renders(n: int = 1080, seed: int = 1) -> dict[str, float]:
    """Fraction of jittered ground-truth renders on which each attribute is measured correctly."""
    from stagemesh.models.tiny_shapes.data import make_dataset

    images, captions = make_dataset(n, seed=seed)
    hits = np.zeros(len(ATTRIBUTES))
    for image, caption in zip(images, captions, strict=True):
        result = score(image, caption)
        hits += [result[name] for name in ATTRIBUTES]
    return {name: float(h / n) for name, h in zip(ATTRIBUTES, hits, strict=True)}
