"""Models loaded in this process, shared where several modules draw the same pictures."""

from __future__ import annotations

import numpy as np
import pytest

from stagemesh.models.tiny_shapes import SHIPPED_DIR
from stagemesh.models.tiny_shapes.evaluate import Generate, pipeline_generator


@pytest.fixture(scope="session")
def shipped_tiny_shapes() -> Generate:
    """The stock pipeline over the shipped tiny-shapes weights (`pipeline_generator`), drawing
    each (prompt, seed) once per session: the shipped weights' floors (test_tiny_shapes.py) and
    the float32 side of the int8 comparison (test_quantization_quality.py) score the same
    pictures (a seeded draw gives the same pixels again). Each call returns a copy."""
    generate = pipeline_generator(SHIPPED_DIR)
    drawn: dict[tuple[str, int], np.ndarray] = {}

    def remembered(prompt: str, seed: int) -> np.ndarray:
        if (prompt, seed) not in drawn:
            drawn[prompt, seed] = generate(prompt, seed)
        return drawn[prompt, seed].copy()

    return remembered
