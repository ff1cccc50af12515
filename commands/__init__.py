"""The `stagemesh` commands, one module per command group: each declares its `Command`s (name,
help, arguments) and what they run. `stagemesh.cli` lists them in one table, parses, and
dispatches. A command module imports only argparse-level code at import time: what a command
runs (torch, the gateway, a benchmark) is imported when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


def _by_command_name(args: argparse.Namespace) -> str:
    return str(args.command)


@dataclass(frozen=True)
class Command:
    """One `stagemesh NAME ...` sub-command."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]
    #: The name its log lines carry (the stage command names its stage).
    log_name: Callable[[argparse.Namespace], str] = _by_command_name
