"""Models loaded in this process, shared where several modules draw the same pictures; the
stage launcher the DiT groups fork their workers from."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np
import pytest

from stagemesh.launcher import Launcher
from stagemesh.models.tiny_shapes import SHIPPED_DIR
from stagemesh.models.tiny_shapes.evaluate import Draw, load_pipeline, stock_drawer
from stagemesh.shared.process import PARENT_PID_ENV


class Drawn:
    """A `Generate` that draws each (prompt, seed) once; `prefetch` draws many prompts in one
    batched pipeline call (a tiny model's step costs about as much for 36 rows as for one, so
    one call per prompt was nearly all overhead). A call returns a copy."""

    def __init__(self, draw: Draw) -> None:
        self._draw = draw
        self._drawn: dict[tuple[str, int], np.ndarray] = {}

    def prefetch(self, prompts: Iterable[str], seed: int = 0) -> None:
        missing = [prompt for prompt in dict.fromkeys(prompts) if (prompt, seed) not in self._drawn]
        if missing:
            images = self._draw(missing, seed)
            self._drawn.update(zip([(prompt, seed) for prompt in missing], images, strict=True))

    def __call__(self, prompt: str, seed: int) -> np.ndarray:
        self.prefetch([prompt], seed)
        return self._drawn[prompt, seed].copy()


@pytest.fixture(scope="session")
def shipped_tiny_shapes() -> Drawn:
    """The stock pipeline over the shipped tiny-shapes weights, drawing each (prompt, seed)
    once per session: the shipped weights' floors (test_tiny_shapes.py) and the float32 side of
    the int8 comparison (test_quantization_quality.py) score the same pictures."""
    return Drawn(stock_drawer(load_pipeline(SHIPPED_DIR)))


@pytest.fixture(scope="session")
def group_launcher() -> Iterator[Launcher]:
    """One stage launcher for every DiT group the model tests start: its workers are forked
    from it, so each loads only its model (not torch & co.: ~6.5 s of CPU a worker)."""
    launcher = Launcher.start({**os.environ, PARENT_PID_ENV: str(os.getpid())})
    yield launcher
    launcher.close()
