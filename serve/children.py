"""How `stagemesh serve` starts a child (`stagemesh ARGV`): forked by the stage launcher, which
has torch & co. imported already, or spawned as `python -m stagemesh ARGV`."""

from __future__ import annotations

import os
from collections.abc import Sequence

from stagemesh.launcher import ChildProcess, Launcher, start_stagemesh
from stagemesh.launcher import stagemesh_command as stagemesh_command  # serve's, re-exported
from stagemesh.shared.process import PARENT_PID_ENV


def child_env() -> dict[str, str]:
    """The environment of serve's children: offline, and told to die with this process."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            PARENT_PID_ENV: str(os.getpid())}


def start_child(argv: Sequence[str], launcher: Launcher | None = None,
                stdout: int | None = None) -> ChildProcess:
    """`stagemesh ARGV` as a child of serve (`start_stagemesh` in `child_env()`)."""
    return start_stagemesh(argv, child_env(), launcher, stdout)
