"""Edits of the tiny-shapes world: recolour, move, reshape; everything else kept.

An `Edit` is a source `Spec`, the attribute it changes (`kind`) and the new value. Source and
target are rendered with the same jitter (size, offset from the nominal position, colour tint),
so the only difference between them is the edited attribute.

Held out: 20% of each kind's (from, to) combinations ("red -> blue", "left -> top",
"square -> triangle"), chosen by a fixed seed, never appear in training; the evaluation edits
only those.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from stagemesh.models.tiny_shapes.data import (
    COLOUR_JITTER,
    COLOURS,
    DISTRACTOR_SHAPES,
    HALF_SIZE_RANGE,
    POSITION_CENTRES,
    POSITION_JITTER,
    POSITIONS,
    SHAPES,
    Spec,
    all_specs,
    render,
)

#: The attributes an edit may change, with their values.
KINDS: dict[str, tuple[str, ...]] = {
    "colour": tuple(COLOURS),
    "position": POSITIONS,
    "shape": SHAPES,
}
#: Each kind's share of the pairs when `pick_edits` balances them, unless told otherwise.
EQUAL_SHARE = 1 / len(KINDS)
_MOVE_PHRASES = {"left": "the left", "right": "the right", "top": "the top",
                 "bottom": "the bottom", "centre": "the centre"}
HELD_OUT_FRACTION = 0.2
SPLIT_SEED = 27


def instruction(kind: str, value: str) -> str:
    """The instruction that sets `kind` to `value`."""
    if kind == "colour":
        return f"make it {value}"
    if kind == "shape":
        return f"make it a {value}"
    if kind == "position":
        return f"move it to {_MOVE_PHRASES[value]}"
    raise ValueError(f"unknown edit kind {kind!r}")


@dataclass(frozen=True)
class Edit:
    """`source` with its `kind` attribute set to `value`."""

    source: Spec
    kind: str
    value: str

    @property
    def target(self) -> Spec:
        return replace(self.source, **{self.kind: self.value})

    @property
    def instruction(self) -> str:
        return instruction(self.kind, self.value)

    @property
    def combination(self) -> tuple[str, str, str]:
        """(kind, from, to): the unit of the held-out split."""
        return self.kind, getattr(self.source, self.kind), self.value


def all_instructions() -> list[str]:
    return [instruction(kind, value) for kind, values in KINDS.items() for value in values]


def all_edits() -> list[Edit]:
    """Every source spec x every edit that changes it (270 x 11), in a fixed order."""
    return [Edit(spec, kind, value) for spec in all_specs() for kind, values in KINDS.items()
            for value in values if value != getattr(spec, kind)]


def no_op_edits() -> list[Edit]:
    """Every source spec x every instruction that names what it already is ("make it a square"
    on a square: the target is the source), 270 x 3. No held-out combination is one of them;
    they show each instruction on one more source than the edits that change something."""
    return [Edit(spec, kind, getattr(spec, kind)) for spec in all_specs() for kind in KINDS]


def held_out_combinations() -> frozenset[tuple[str, str, str]]:
    """20% of each kind's (kind, from, to) combinations (at least one), fixed by SPLIT_SEED."""
    rng = np.random.default_rng(SPLIT_SEED)
    held: set[tuple[str, str, str]] = set()
    for kind, values in KINDS.items():
        pairs = [(kind, a, b) for a, b in itertools.permutations(values, 2)]
        n = max(1, round(HELD_OUT_FRACTION * len(pairs)))
        held.update(pairs[i] for i in rng.choice(len(pairs), size=n, replace=False))
    return frozenset(held)


def split(*, no_ops: bool = False) -> tuple[list[Edit], list[Edit]]:
    """(training edits, held-out edits); `no_ops` adds `no_op_edits()` to the training ones."""
    held = held_out_combinations()
    edits = all_edits()
    training = [e for e in edits if e.combination not in held]
    return training + (no_op_edits() if no_ops else []), [e for e in edits if e.combination in held]


def render_pair(edit: Edit, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) uint8 (32, 32, 3) images sharing one draw of jitter."""
    dx, dy = rng.uniform(-POSITION_JITTER, POSITION_JITTER, size=2)
    half = float(rng.uniform(*HALF_SIZE_RANGE))
    tint = rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, size=3)

    def draw(spec: Spec) -> np.ndarray:
        cx, cy = POSITION_CENTRES[spec.position]
        rgb = np.clip(np.array(COLOURS[spec.colour]) + tint, 0, 255)
        return render(spec, centre=(cx + dx, cy + dy), half=half,
                      colour=(int(rgb[0]), int(rgb[1]), int(rgb[2])))

    return draw(edit.source), draw(edit.target)


def with_distractor(edit: Edit, shape: str) -> Edit:
    """`edit` from a source of the distractor `shape` (`DISTRACTOR_SHAPES`): a recolour or move
    keeps that shape, a reshape turns it into the world's shape asked for."""
    return replace(edit, source=replace(edit.source, shape=shape))


def make_dataset(edits: list[Edit], n: int, seed: int = 0, *, balance_kinds: bool = False,
                 reshape_share: float = EQUAL_SHARE, distractors: float = 0.0
                 ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """`n` rendered pairs of `pick_edits`: uint8 sources and targets (n, 32, 32, 3) and their
    instructions."""
    rng = np.random.default_rng(seed)
    chosen = pick_edits(edits, n, rng, balance_kinds=balance_kinds, reshape_share=reshape_share,
                        distractors=distractors)
    pairs = [render_pair(edit, rng) for edit in chosen]
    return (np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]),
            [edit.instruction for edit in chosen])


def _kind_counts(n: int, groups: int, reshape_share: float | None) -> list[int]:
    """How many of `n` pairs each group gets: equal shares (the first groups one more where `n`
    does not divide), or the last group (`KINDS`' reshapes) `reshape_share` of them."""
    if reshape_share is None or reshape_share == EQUAL_SHARE:
        return [n // groups + (k < n % groups) for k in range(groups)]
    last = round(n * reshape_share)
    return [*_kind_counts(n - last, groups - 1, None), last]


def pick_edits(edits: list[Edit], n: int, rng: np.random.Generator, *,
               balance_kinds: bool = False, reshape_share: float = EQUAL_SHARE,
               distractors: float = 0.0) -> list[Edit]:
    """`n` edits cycling through `edits` in an order drawn from `rng`.

    `balance_kinds` cycles through each kind's edits separately, a third of the pairs each:
    cycling through all edits gives each kind its share of the edits (reshape, with 3 shapes,
    only 19%), and the held-out reshape was the kind the model learned least. With it,
    `reshape_share` gives the reshapes that share of the pairs instead, the other kinds
    splitting the rest.

    `distractors`: that fraction of the edits has its source drawn as a distractor shape
    (`with_distractor`), the instruction unchanged. With the world's three shapes, each
    "make it a <shape>" is otherwise seen from one or two source shapes only ("make it a
    square" from circles alone once triangle -> square is held out), and the model learns it
    as a rule of those sources; from three more, it can read as "whatever the source is". No
    held-out (kind, from, to) is one of these: their "from" is no shape of the world."""
    if not 0.0 < reshape_share < 1.0 or (reshape_share != EQUAL_SHARE and not balance_kinds):
        raise ValueError(f"reshape_share must be in (0, 1) and needs balance_kinds, got "
                         f"{reshape_share} (balance_kinds={balance_kinds})")
    groups = ([[i for i, e in enumerate(edits) if e.kind == kind] for kind in KINDS]
              if balance_kinds else [list(range(len(edits)))])
    groups = [g for g in groups if g]
    counts = _kind_counts(n, len(groups), reshape_share if balance_kinds else None)
    picks = [np.asarray(g)[np.concatenate([rng.permutation(len(g))
                                           for _ in range(count // len(g) + 1)])[:count]]
             for g, count in zip(groups, counts, strict=True)]
    order = np.concatenate(picks)
    if balance_kinds:
        order = order[rng.permutation(n)]
    chosen = [edits[i] for i in order]
    if distractors > 0:  # no draw otherwise: the rng's stream (the dataset) stays as it was
        chosen = [with_distractor(e, str(rng.choice(DISTRACTOR_SHAPES)))
                  if rng.random() < distractors else e for e in chosen]
    return chosen
