"""The model folders of the recipes, resolved by one `stagemesh model prepare` child, so that
building a model never loads torch into serve's process (and torch is imported once for all
the specs)."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from stagemesh.launcher import Launcher
from stagemesh.serve.children import start_child

MODEL_PREPARE_TIMEOUT_S = 600.0  # building a seeded built-in model the first time


def _read_to_end(fd: int, deadline: float) -> bytes:
    """Everything written to the pipe `fd` until its writers close it; TimeoutError after
    `deadline` (time.monotonic)."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def prepare_models(specs: Iterable[str], timeout: float = MODEL_PREPARE_TIMEOUT_S,
                   launcher: Launcher | None = None) -> dict[str, Path]:
    """Model spec -> folder, every distinct spec resolved by one `stagemesh model prepare`
    child (forked by `launcher` when given)."""
    distinct = list(dict.fromkeys(specs))
    if not distinct:
        return {}
    deadline = time.monotonic() + timeout
    read_end, write_end = os.pipe()
    try:
        try:
            child = start_child(["model", "prepare", *distinct], launcher, stdout=write_end)
        finally:
            os.close(write_end)  # the child has its own: the pipe ends when the child does
        try:
            out = _read_to_end(read_end, deadline)
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, subprocess.TimeoutExpired) as error:
            child.kill()
            child.wait()
            raise TimeoutError(f"preparing models {distinct} took longer than {timeout:.0f} s"
                               ) from error
    finally:
        os.close(read_end)
    folders = out.decode().splitlines()
    if child.returncode != 0 or len(folders) != len(distinct):
        failed = distinct[min(len(folders), len(distinct) - 1)]  # one line per spec done
        raise RuntimeError(f"preparing model {failed!r} failed (exit code {child.returncode}); "
                           "its error is logged above")
    return {spec: Path(folder) for spec, folder in zip(distinct, folders, strict=True)}
