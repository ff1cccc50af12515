"""The stage launcher: a fork server ("zygote") that imports torch, diffusers, transformers and
the stage modules once, then forks every process `stagemesh serve` asks it for.

Why: importing a stage costs ~6.5 s of CPU (torch, diffusers and transformers, and the
pipelines our modules pull in). The default mesh starts 17 stage processes plus a `model
prepare` child, so on two cores that was most of serve's minute of start-up. A forked child
shares the launcher's modules copy-on-write and only loads its model.

Run as `python -m stagemesh.launcher --fd N` by serve, never by hand. The requests come over
that file descriptor, a SOCK_SEQPACKET socket (one JSON object per packet, never pickle), not
over stdin/stdout: a child inherits the launcher's stdio, which is serve's, so a stage's output
lands where it did when serve spawned it.

    serve -> launcher   {"id": 7, "argv": ["stage", "dit", ...], "env": {...}}
                        (one file descriptor may ride along: the child's stdout)
    launcher -> serve   {"id": 7, "pid": 1234}          the child runs `stagemesh ARGV`
                        {"id": 7, "error": "..."}       nothing forked (bad request, unsafe)
                        {"pid": 1234, "returncode": 0}  a child exited (-N: killed by signal N)

Fork safety: the launcher starts no thread, gRPC channel or server, or OpenMP region, and
checks before each fork that it runs a single thread; if not, it refuses, and serve spawns
`python -m stagemesh ...` instead. Lifetime: the launcher dies with serve, each child with the
launcher (PR_SET_PDEATHSIG, see `cli.die_with_parent`); it exits when serve closes the socket.
Linux only; `STAGEMESH_STAGE_LAUNCHER=spawn` turns it off.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import enum
import gc
import importlib
import itertools
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn, Protocol

from stagemesh.cli import (
    PARENT_PID_ENV,
    die_with_parent,
    exit_without_teardown,
    keep_freed_memory,
    quiet_openmp_waits,
)
from stagemesh.cli import main as stagemesh_main

log = logging.getLogger(__name__)

#: How serve starts its stage processes: "fork" (through the launcher, the default on Linux)
#: or "spawn" (each one `python -m stagemesh ...`, importing everything itself).
LAUNCHER_ENV = "STAGEMESH_STAGE_LAUNCHER"
#: What the launcher imports before its first fork: every stage's modules that load without
#: starting a thread. Not the Piper stages' (onnxruntime starts a thread and opens a database
#: when it loads): those import it after the fork, ~0.1 s.
PRELOADED = (
    "torch", "diffusers", "transformers",
    "stagemesh.shared.stage_runtime", "stagemesh.shared.tracing",
    "stagemesh.models.registry", "stagemesh.services.registry",
    "stagemesh.services.tokenizer.servicer", "stagemesh.services.dit.servicer",
    "stagemesh.services.vae.servicer", "stagemesh.services.thinker.servicer",
    "stagemesh.services.talker", "stagemesh.services.talker.servicer",
    "stagemesh.services.codec", "stagemesh.services.codec.servicer",
)
#: Largest request (a whole environment) or reply, in bytes.
MAX_MESSAGE_BYTES = 1 << 20
#: How long serve waits for the launcher to answer a request: the first answer comes after
#: its imports (~6.5 s of CPU).
REPLY_TIMEOUT_S = 120.0
#: How long serve waits for the launcher to exit once the socket is closed.
CLOSE_TIMEOUT_S = 10.0
#: How often serve looks for a child whose launcher is gone (no exit report will come).
ORPHAN_POLL_S = 0.1
#: A child gets the signal handlers a fresh interpreter has, not the launcher's.
CHILD_SIGNALS: dict[int, Callable[[int, FrameType | None], object] | int] = {
    signal.SIGINT: signal.default_int_handler, signal.SIGCHLD: signal.SIG_DFL}
#: proc(5): /proc/<pid>/stat fields 48 and 49 (arg_start, arg_end), counted from the state
#: field (3) that follows the command name.
STAT_ARG_START, STAT_ARG_END = 48 - 3, 49 - 3


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


# -- The protocol (both ends) ----------------------------------------------------------------


class Refused(Exception):
    """A request the launcher does not run (bad, or no safe fork); `request_id` when it could
    read one."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class LaunchRequest:
    """Fork a child that runs `stagemesh ARGV` in environment `env`."""

    id: int
    argv: list[str]
    env: dict[str, str]

    def encode(self) -> bytes:
        return json.dumps({"id": self.id, "argv": self.argv, "env": self.env}).encode()

    @classmethod
    def decode(cls, data: bytes) -> LaunchRequest:
        try:
            message = json.loads(data)
        except ValueError as error:  # UnicodeDecodeError too
            raise Refused(f"a request is one JSON object: {error}") from None
        if not isinstance(message, dict):
            raise Refused("a request is one JSON object")
        ident = message.get("id")
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise Refused("'id' must be an integer")
        argv, env = message.get("argv"), message.get("env")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise Refused("'argv' must be a non-empty list of strings", ident)
        if not (isinstance(env, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise Refused("'env' must map strings to strings", ident)
        return cls(ident, argv, env)


def _send(sock: socket.socket, message: Mapping[str, object], fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


# -- The launcher process --------------------------------------------------------------------


def preload() -> None:
    """Import what stages share, as a stage would (OpenMP and malloc set up first)."""
    quiet_openmp_waits()
    keep_freed_memory()
    # numpy's OpenBLAS starts a pool of idle threads when it loads, which would make every
    # fork unsafe. Stages compute in torch (MKL, OpenMP), so their numpy (the launcher's copy)
    # runs BLAS on the calling thread. An operator's own setting wins; stages are then
    # spawned if it starts threads (the launcher says so).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError as error:  # an install without it: the stage needing it says so
            log.debug("not preloaded: %s (%s)", name, error)
    # Objects that exist now are never freed: keep the collector from writing to (and so
    # copying) the pages the children share.
    gc.freeze()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _retitle(argv: Sequence[str]) -> None:
    """Show `stagemesh ARGV` as this process's command line (ps, top, pgrep -f), cut to the
    launcher's own: a forked child would otherwise look like the launcher."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[STAT_ARG_START]), int(fields[STAT_ARG_END])
    except (OSError, IndexError, ValueError):
        return
    room = end - start - 1  # the area's last NUL stays: the kernel then reads it as argv
    title = b"\0".join(arg.encode() for arg in ("stagemesh", *argv))[:max(room, 0)]
    ctypes.memmove(start, title.ljust(room + 1, b"\0"), room + 1)


def _exit_status(code: object) -> int:
    """The exit status an interpreter gives `SystemExit(code)` (printing a message code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _run_child(request: LaunchRequest, stdout: int | None, launcher_pid: int,
               inherited: Sequence[int]) -> NoReturn:
    """In the forked child: become `stagemesh ARGV` as `python -m stagemesh` would be."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        for signum, handler in CHILD_SIGNALS.items():
            signal.signal(signum, handler)
        for fd in inherited:  # the launcher's: a child holding the socket would hide its exit
            os.close(fd)
        if stdout is not None:
            os.dup2(stdout, 1)
            os.close(stdout)
        os.environ.clear()
        os.environ.update(request.env)
        os.environ[PARENT_PID_ENV] = str(launcher_pid)  # it dies with the launcher
        sys.argv[1:] = request.argv
        _retitle(request.argv)
        stagemesh_main(request.argv)
        status = 0
    except SystemExit as done:
        status = _exit_status(done.code)
    except BaseException:
        log.exception("stagemesh %s failed", " ".join(request.argv[:2]))
    exit_without_teardown(status)


def _report_exits(sock: socket.socket) -> None:
    """Reap every child that exited and tell serve its status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _handle(sock: socket.socket, data: bytes, fds: list[int], flags: int,
            inherited: Sequence[int]) -> None:
    """Fork the child a request asks for and answer with its pid, or with why not."""
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise Refused(f"a request is at most {MAX_MESSAGE_BYTES} bytes and one fd")
        request = LaunchRequest.decode(data)
        if len(fds) > 1:
            raise Refused("at most one file descriptor (the child's stdout)", request.id)
        threads = _threads()
        if threads != 1:
            raise Refused(f"the launcher runs {threads} threads (a library it imported "
                          "started them), so a fork is unsafe", request.id)
        launcher_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError as error:  # out of memory or processes: serve spawns instead
            raise Refused(f"fork failed: {error}", request.id) from error
        if pid == 0:
            _run_child(request, fds[0] if fds else None, launcher_pid, inherited)
        _send(sock, {"id": request.id, "pid": pid})
    except Refused as error:
        log.warning("refused a request: %s", error)
        _send(sock, {"id": error.request_id, "error": str(error)})
    finally:
        for fd in fds:
            os.close(fd)


def serve_requests(sock: socket.socket) -> None:
    """Answer requests and report exits until serve closes the socket."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # the wake-up fd does the work
    inherited = (sock.fileno(), wake_read, wake_write)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    while True:
        ready = dict(poller.poll())
        if wake_read in ready:
            os.read(wake_read, 4096)
        _report_exits(sock)
        if sock.fileno() in ready:
            data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
            if not data:  # serve closed its end (or died)
                return
            _handle(sock, data, fds, flags, inherited)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stagemesh.launcher",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the request socket")
    args = parser.parse_args(argv)
    die_with_parent()
    from stagemesh.shared.logs import configure_logging

    configure_logging("stage-launcher")
    # Ctrl-C reaches the whole process group: serve stops the stages, then closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    preload()
    log.debug("preloaded %d modules; %d threads", len(sys.modules), _threads())
    with contextlib.suppress(BrokenPipeError):  # serve went away mid-reply; children follow
        serve_requests(sock)


# -- serve's end -----------------------------------------------------------------------------


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


if __name__ == "__main__":
    main(sys.argv[1:])
