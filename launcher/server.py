"""The launcher process: imports what stages share once, then forks every child serve asks for
(`python -m stagemesh.launcher --fd N`; see `stagemesh.launcher` for why and how)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import logging
import os
import select
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from stagemesh.cli import main as stagemesh_main
from stagemesh.launcher.protocol import MAX_MESSAGE_BYTES, LaunchRequest, Refused, send
from stagemesh.shared.process import (
    PARENT_PID_ENV,
    die_with_parent,
    exit_without_teardown,
    keep_freed_memory,
    quiet_openmp_waits,
)

log = logging.getLogger(__name__)

#: What the launcher imports before its first fork: every stage's modules that load without
#: starting a thread. Not the Piper stages' (onnxruntime starts a thread and opens a database
#: when it loads): those import it after the fork, ~0.1 s.
PRELOADED = (
    "torch", "diffusers", "transformers",
    "stagemesh.shared.stage_runtime", "stagemesh.shared.tracing",
    "stagemesh.models.registry", "stagemesh.services.registry",
    "stagemesh.services.tokenizer.servicer", "stagemesh.services.dit.servicer",
    "stagemesh.services.vae.servicer", "stagemesh.services.thinker.servicer",
    # the CSM family's builders (services.registry.STAGE_BUILDERS), their generic servicers
    # with them
    "stagemesh.services.talker.csm_servicer", "stagemesh.services.codec.csm_servicer",
)
#: A child gets the signal handlers a fresh interpreter has, not the launcher's.
CHILD_SIGNALS: dict[int, Callable[[int, FrameType | None], object] | int] = {
    signal.SIGINT: signal.default_int_handler, signal.SIGCHLD: signal.SIG_DFL}
#: proc(5): /proc/<pid>/stat fields 48 and 49 (arg_start, arg_end), counted from the state
#: field (3) that follows the command name.
STAT_ARG_START, STAT_ARG_END = 48 - 3, 49 - 3


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
        send(sock, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


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
        send(sock, {"id": request.id, "pid": pid})
    except Refused as error:
        log.warning("refused a request: %s", error)
        send(sock, {"id": error.request_id, "error": str(error)})
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
