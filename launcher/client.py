"""serve's end of the stage launcher: start it, ask it for children, read their exit statuses,
and notice when it is gone (then serve spawns its children itself)."""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from stagemesh.launcher.protocol import MAX_MESSAGE_BYTES, LaunchRequest

log = logging.getLogger(__name__)

#: How serve starts its stage processes: "fork" (through the launcher, the default on Linux)
#: or "spawn" (each one `python -m stagemesh ...`, importing everything itself).
LAUNCHER_ENV = "STAGEMESH_STAGE_LAUNCHER"
#: How long serve waits for the launcher to answer a request: the first answer comes after
#: its imports (~6.5 s of CPU).
REPLY_TIMEOUT_S = 120.0
#: How long serve waits for the launcher to exit once the socket is closed.
CLOSE_TIMEOUT_S = 10.0
#: How often serve looks for a child whose launcher is gone (no exit report will come).
ORPHAN_POLL_S = 0.1

class StartMode(enum.Enum):
    """How serve starts its children."""

    FORK = "fork"
    SPAWN = "spawn"


def start_mode(environ: Mapping[str, str] | None = None) -> StartMode:
    """$STAGEMESH_STAGE_LAUNCHER, fork by default; always spawn elsewhere than Linux (the
    launcher's safety checks and its children's death with it need Linux)."""
    environ = os.environ if environ is None else environ
    value = environ.get(LAUNCHER_ENV, "").strip().lower() or StartMode.FORK.value
    try:
        mode = StartMode(value)
    except ValueError:
        raise SystemExit(f"{LAUNCHER_ENV} must be one of "
                         f"{[m.value for m in StartMode]}, got {value!r}") from None
    return mode if sys.platform.startswith("linux") else StartMode.SPAWN


class ChildProcess(Protocol):
    """What serve needs of a child it started: a subprocess.Popen or a ForkedChild."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class LauncherUnavailable(RuntimeError):
    """The launcher cannot fork this child (gone, or it refused): start it another way."""


class ForkedChild:
    """A child the launcher forked, used like a subprocess.Popen (the parts serve needs); its
    exit status comes from the launcher's reports."""

    def __init__(self, launcher: Launcher, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self._launcher = launcher

    @property
    def returncode(self) -> int | None:
        return self._launcher.exit_status(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        status = self._launcher.wait_exit(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return status

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited, not yet reported
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def exited(pid: int) -> bool:
    """Whether `pid` has exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Launcher:
    """serve's end of the launcher: starts it, asks it for children, keeps their exit
    statuses (a reader thread), and notices when it is gone."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.process = process
        self._sock = sock
        self._ids = itertools.count(1)
        self._asking = threading.Lock()  # one request in flight
        self._changed = threading.Condition()  # guards everything below
        self._replies: dict[int, dict[str, object]] = {}
        self._exits: dict[int, int] = {}
        self._unusable: str | None = None  # why no more children are forked
        self._connected = True  # exit reports still come
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="stage-launcher", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, env: Mapping[str, str]) -> Launcher:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", "stagemesh.launcher", "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=dict(env))
        log.info("stage launcher started (pid %d): stages are forked from it", process.pid)
        return cls(process, ours)

    def run(self, argv: Sequence[str], env: Mapping[str, str],
            stdout: int | None = None) -> ForkedChild:
        """Fork `stagemesh ARGV` in `env` (with `stdout` as its stdout); LauncherUnavailable
        if the launcher cannot, now or ever after."""
        with self._asking:
            with self._changed:
                if self._unusable:
                    raise LauncherUnavailable(self._unusable)
            request = LaunchRequest(next(self._ids), list(argv), dict(env))
            try:
                socket.send_fds(self._sock, [request.encode()],
                                [] if stdout is None else [stdout])
            except OSError as error:
                raise self._lose(f"cannot reach the stage launcher: {error}") from error
            reply = self._reply(request.id)
        pid = reply.get("pid")
        if not isinstance(pid, int):
            raise self._lose(f"the stage launcher refused: {reply.get('error')}")
        return ForkedChild(self, pid, argv)

    def exit_status(self, pid: int) -> int | None:
        """The child's exit status, None while it runs."""
        with self._changed:
            return self._exit_status(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status once it exits, None if it runs after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while (status := self._exit_status(pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if not self._connected:  # no report will come: look again soon
                    left = ORPHAN_POLL_S if left is None else min(left, ORPHAN_POLL_S)
                self._changed.wait(left)
            return status

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Close the socket: the launcher exits (any child it still has gets SIGTERM)."""
        with self._changed:
            self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout)
        self._sock.close()

    def _exit_status(self, pid: int) -> int | None:
        if pid not in self._exits and not self._connected and exited(pid):
            # Its launcher died, so Linux sent it SIGTERM (PR_SET_PDEATHSIG); whoever reaped
            # it got its real status.
            self._exits[pid] = -signal.SIGTERM
        return self._exits.get(pid)

    def _reply(self, request_id: int) -> dict[str, object]:
        with self._changed:
            self._changed.wait_for(lambda: request_id in self._replies or not self._connected,
                                   REPLY_TIMEOUT_S)
            reply = self._replies.pop(request_id, None)
        if reply is None:
            raise self._lose(f"the stage launcher did not answer within {REPLY_TIMEOUT_S:.0f} s"
                             if self._connected else "the stage launcher is gone")
        return reply

    def _lose(self, why: str) -> LauncherUnavailable:
        """Fork no more children (say why, once); the error to raise."""
        with self._changed:
            first, self._unusable = self._unusable is None, self._unusable or why
        if first:
            log.warning("%s; stages start as separate processes from now on", why)
        return LauncherUnavailable(why)

    def _read(self) -> None:
        """Reader thread: file replies and exit reports until the launcher's end closes."""
        while data := self._receive():
            try:
                message = json.loads(data)
                with self._changed:
                    if "returncode" in message:
                        self._exits[int(message["pid"])] = int(message["returncode"])
                    else:
                        self._replies[int(message["id"])] = message
                    self._changed.notify_all()
            except (ValueError, TypeError, KeyError):
                log.warning("unreadable message from the stage launcher: %r", data[:200])
        with self._changed:
            self._connected, closing = False, self._closing
            self._changed.notify_all()
        if not closing:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(CLOSE_TIMEOUT_S)
            log.error("the stage launcher (pid %d) exited with code %s; the stages it forked "
                      "stop with it", self.process.pid, self.process.returncode)
            self._lose("the stage launcher is gone")

    def _receive(self) -> bytes:
        try:
            return self._sock.recv(MAX_MESSAGE_BYTES)
        except OSError:
            return b""



def stagemesh_command(*args: str) -> list[str]:
    """`python -m stagemesh ARGS` with this interpreter (the same install as this process)."""
    return [sys.executable, "-m", "stagemesh", *args]


def start_stagemesh(argv: Sequence[str], env: Mapping[str, str],
                    launcher: Launcher | None = None, stdout: int | None = None) -> ChildProcess:
    """`stagemesh ARGV` as a child in `env` (with `stdout` as its stdout): forked by
    `launcher`; spawned as `python -m stagemesh ARGV` without one, or once it cannot fork (it
    logs why)."""
    if launcher is not None:
        with contextlib.suppress(LauncherUnavailable):
            return launcher.run(argv, env, stdout)
    return subprocess.Popen(stagemesh_command(*argv), env=dict(env), stdout=stdout)
