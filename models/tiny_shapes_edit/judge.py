"""Judging an edit from pixels alone, with the tiny-shapes scorer (`scoring.measure`).

An edit is correct when the measured value of the edited attribute is the one asked for, and
kept when every other attribute (of colour, shape, position, background) measures as the
source's. `judge_accuracy_on_renders` checks the judge on ground-truth target renders: a figure
above it cannot be trusted further than the judge itself.
"""

from __future__ import annotations

import numpy as np

from stagemesh.models.tiny_shapes.scoring import ATTRIBUTES, Measurement, measure
from stagemesh.models.tiny_shapes_edit.data import KINDS, Edit, render_pair, split

VERDICTS: tuple[str, ...] = ("edited", "kept")


def judge_measurement(edit: Edit, seen: Measurement) -> dict[str, bool]:
    """{"edited": the edited attribute reads as asked, "kept": every other one as the source's}."""
    kept = all(getattr(seen, name) == getattr(edit.source, name)
               for name in ATTRIBUTES if name != edit.kind)
    return {"edited": getattr(seen, edit.kind) == edit.value, "kept": kept}


def judge(edit: Edit, image: np.ndarray) -> dict[str, bool]:
    """Judges a uint8 RGB (H, W, 3) result of `edit`."""
    return judge_measurement(edit, measure(image))


def judge_accuracy_on_renders(n_per_kind: int = 100, seed: int = 1) -> dict[str, dict[str, float]]:
    """Per kind, how often the judge passes the true target render of a held-out edit."""
    rng = np.random.default_rng(seed)
    _, held_out = split()
    result: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        edits = [e for e in held_out if e.kind == kind]
        picks = [edits[i] for i in rng.permutation(len(edits))[:n_per_kind]]
        verdicts = [judge(e, render_pair(e, rng)[1]) for e in picks]
        result[kind] = {v: float(np.mean([x[v] for x in verdicts])) for v in VERDICTS}
    return result
