"""The running `stagemesh serve` process hosts the gateway and loads no torch; its stages do.

Read from /proc/<pid>/maps, the shared libraries a process has actually loaded: torch's native
libraries (libtorch*, torch/_C) appear there as soon as `import torch` runs anywhere in it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Protocol

import pytest

from .conftest import stage_processes


class _Served(Protocol):
    """The part of the e2e conftest's `Served` used here."""

    process: subprocess.Popen[bytes]


def _mapped_files(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("needs Linux /proc")
    fields = (line.split(maxsplit=5) for line in maps.read_text().splitlines())
    return {entry[5] for entry in fields if len(entry) == 6}


def _torch_libraries(pid: int) -> list[str]:
    return sorted(path for path in _mapped_files(pid) if "/torch/" in path or "libtorch" in path)


def test_the_serve_process_loads_no_torch_while_its_stages_do(served: _Served) -> None:
    pid = served.process.pid
    assert any("grpc" in path for path in _mapped_files(pid))  # the gateway's own native code
    assert _torch_libraries(pid) == []
    stages = list(stage_processes(pid))
    assert len(stages) >= 5  # tokenizer, dit, vae, talker, codec
    assert all(_torch_libraries(stage) for stage in stages)  # so the check does see torch
