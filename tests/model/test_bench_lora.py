"""`stagemesh bench lora`'s diffusers arm on the tiny model: the eight seeded adapters are
written from the pipeline's own transformer, load into it, and `set_adapters` switches between
them per request."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.bench.lora import Cell, Run, parse, peer_serial, peer_with_adapters
from stagemesh.models.registry import resolve_model

pytestmark = pytest.mark.timeout(120)


def test_the_peer_switches_adapters_per_request(tmp_path: Path) -> None:
    options = parse(["--dry-run", "--out", str(tmp_path)])
    run = options.runs[0]
    pipe = peer_with_adapters(resolve_model(run.model), tmp_path / "loras")
    assert sorted(p.name for p in (tmp_path / "loras").iterdir()) == [
        f"lora-{i}" for i in range(8)]
    assert set(pipe.get_list_adapters()["transformer"]) == {f"lora-{i}" for i in range(8)}
    cell = Cell()
    peer_serial(pipe, Run(run.model, run.size), options, cell)
    assert len(cell.latencies) == options.concurrency and cell.images_per_s[0] > 0
    assert pipe.get_active_adapters() == ["lora-1"]  # the last request's
