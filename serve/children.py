"""How `stagemesh serve` starts a child (`stagemesh ARGV`): forked by the stage launcher, which
has torch & co. imported already, or spawned as `python -m stagemesh ARGV`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence

from stagemesh.launcher import ChildProcess, Launcher, LauncherUnavailable
from stagemesh.shared.process import PARENT_PID_ENV


def stagemesh_command(*args: str) -> list[str]:
    """`python -m stagemesh ARGS` with this interpreter (the same install as this process)."""
    return [sys.executable, "-m", "stagemesh", *args]


def child_env() -> dict[str, str]:
    """The environment of serve's children: offline, and told to die with this process."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            PARENT_PID_ENV: str(os.getpid())}


def start_child(argv: Sequence[str], launcher: Launcher | None = None,
                stdout: int | None = None) -> ChildProcess:
    """`stagemesh ARGV` as a child of serve (with `stdout` as its stdout): forked by the
    launcher; spawned as `python -m stagemesh ARGV` without one, or once it is gone (it logs
    why)."""
    env = child_env()
    if launcher is not None:
        with contextlib.suppress(LauncherUnavailable):
            return launcher.run(argv, env, stdout)
    return subprocess.Popen(stagemesh_command(*argv), env=env, stdout=stdout)
