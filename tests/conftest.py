"""Shared test setup: offline switches, a tier for every test, one torch thread.

Tiers come from the folder a test lives in, so a test cannot forget its marker:

    tests/unit         unit          no model, no gRPC server (`make test-fast`)
    tests/model        model         loads a model in this process
    tests/integration  integration   real gRPC servers on loopback, or a built wheel
    tests/e2e          e2e           `stagemesh serve` as a subprocess

Nothing in the test suite may reach the network. Torch is not imported here: the unit tier
mostly runs without it.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TIERS = ("unit", "model", "integration", "e2e")
#: Tiers whose tests run models in this process.
MODEL_TIERS = frozenset({"model", "integration"})
TESTS_DIR = Path(__file__).resolve().parent


def tier_of(path: Path) -> str:
    """The tier of a test file: the first folder below tests/."""
    resolved = path.resolve()
    relative = resolved.relative_to(TESTS_DIR) if TESTS_DIR in resolved.parents else Path(".")
    if len(relative.parts) < 2 or relative.parts[0] not in TIERS:
        raise pytest.UsageError(f"{path}: a test belongs in tests/<tier>/, tiers: {TIERS}")
    return relative.parts[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item.path))


@functools.cache
def _one_torch_thread() -> None:
    """In-process models run on one thread: on a 2-core machine shared with stage subprocesses,
    a second torch thread mostly waits for a busy core (10x slower steps were measured)."""
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures build anything, in the tiers that run torch here."""
    if "torch" in sys.modules or any(item.get_closest_marker(t) for t in MODEL_TIERS):
        _one_torch_thread()
