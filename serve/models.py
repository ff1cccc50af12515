"""The model folders of the recipes, resolved by one `stagemesh model prepare` child, so that
building a model never loads torch into serve's process, nor opens a model folder there (and
torch is imported once for all the specs). The child also says which optional extra each
stage of a folder's family needs (`stagemesh.models.families.STAGE_EXTRAS`)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stagemesh.launcher import Launcher
from stagemesh.serve.children import start_child
from stagemesh.shared.extras import EXTRAS, Extra

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


@dataclass(frozen=True)
class PreparedModel:
    """A model spec's folder, and the optional extra each stage of its family needs."""

    folder: Path
    extras: Mapping[str, Extra] = field(default_factory=dict)


def prepare_models(specs: Iterable[str], timeout: float = MODEL_PREPARE_TIMEOUT_S,
                   launcher: Launcher | None = None) -> dict[str, Path]:
    """Model spec -> folder, every distinct spec resolved by one `stagemesh model prepare`
    child (forked by `launcher` when given)."""
    prepared = prepare(specs, timeout, launcher)
    return {spec: model.folder for spec, model in prepared.items()}


def builtin_extras(specs: Iterable[str]) -> dict[str, dict[str, Extra]]:
    """Model spec -> stage -> the extra it needs, for the built-in specs whose family the
    registry knows before building (the others are known once prepared). Imports the
    registry's tables alone, no model library."""
    from stagemesh.models.registry import builtin_stage_extras

    return {spec: builtin_stage_extras(spec) for spec in specs}


def prepare(specs: Iterable[str], timeout: float = MODEL_PREPARE_TIMEOUT_S,
            launcher: Launcher | None = None) -> dict[str, PreparedModel]:
    """Model spec -> its folder and the extras its stages need, as `prepare_models`."""
    distinct = list(dict.fromkeys(specs))
    if not distinct:
        return {}
    deadline = time.monotonic() + timeout
    read_end, write_end = os.pipe()
    try:
        try:
            child = start_child(["model", "prepare", "--json", *distinct], launcher,
                                stdout=write_end)
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
    lines = out.decode().splitlines()
    if child.returncode != 0 or len(lines) != len(distinct):
        failed = distinct[min(len(lines), len(distinct) - 1)]  # one line per spec done
        raise RuntimeError(f"preparing model {failed!r} failed (exit code {child.returncode}); "
                           "its error is logged above")
    return {spec: _prepared(line) for spec, line in zip(distinct, lines, strict=True)}


def _prepared(line: str) -> PreparedModel:
    """One line of `stagemesh model prepare --json`."""
    reply = json.loads(line)
    return PreparedModel(Path(reply["folder"]), {stage: EXTRAS[name] for stage, name
                                                 in reply["extras"].items()})
