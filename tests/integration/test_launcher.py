"""The stage launcher (serve's fork server) with real processes: a forked `stagemesh stage`
serves, its exit statuses read like Popen's, it dies with the launcher, serve falls back to
spawning once the launcher is gone, and the protocol refuses bad requests without dying."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagemesh.gateway.recipes import StageEndpoint
from stagemesh.launcher import Launcher, LauncherUnavailable, exited
from stagemesh.models.registry import SHIPPED_TINY_SHAPES
from stagemesh.serve import (
    StageLaunch,
    free_port,
    prepare_models,
    spawn_stage,
    stop_processes,
    wait_serving,
)
from stagemesh.shared.process import PARENT_PID_ENV

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
              pytest.mark.timeout(240)]

#: How long a test waits for a reply or an exit that should come at once.
REPLY_S = 60.0


def _env() -> dict[str, str]:
    """A child's environment: it dies with this process (as serve's children do with serve)."""
    return {**os.environ, PARENT_PID_ENV: str(os.getpid())}


@pytest.fixture
def launcher() -> Iterator[Launcher]:
    started = Launcher.start(_env())
    yield started
    started.close()


def _tokenizer() -> StageLaunch:
    """The cheapest stage: the shipped tiny-shapes tokenizer on a free port."""
    return StageLaunch(StageEndpoint("tokenizer", f"127.0.0.1:{free_port()}"),
                       SHIPPED_TINY_SHAPES)


def test_a_forked_stage_serves_and_exits_like_a_popen_child(launcher: Launcher,
                                                            tmp_path: Path) -> None:
    assert prepare_models([str(tmp_path)], launcher=launcher) == {str(tmp_path): tmp_path}
    launch = _tokenizer()
    stage = spawn_stage(launch, launcher)
    wait_serving(launch, stage)  # SERVING, from the pid the launcher reported
    assert Path(f"/proc/{stage.pid}/cmdline").read_bytes().startswith(
        b"stagemesh\0stage\0tokenizer\0--port\0")  # ps tells the stages apart
    os.kill(stage.pid, signal.SIGKILL)
    assert stage.wait(timeout=REPLY_S) == -signal.SIGKILL
    assert stage.poll() == stage.returncode == -signal.SIGKILL

    stage = spawn_stage(launch, launcher)  # a restart on the same port
    wait_serving(launch, stage)
    stop_processes([stage])  # SIGTERM: the stage drains and exits cleanly
    assert stage.returncode == 0


def test_a_stage_dies_with_its_launcher_and_serve_then_spawns(launcher: Launcher,
                                                               tmp_path: Path) -> None:
    launch = _tokenizer()
    stage = spawn_stage(launch, launcher)
    wait_serving(launch, stage)
    launcher.process.kill()
    # No exit report can come now: the handle sees the stage go (SIGTERM from Linux).
    assert stage.wait(timeout=REPLY_S) == -signal.SIGTERM
    assert exited(stage.pid)
    with pytest.raises(LauncherUnavailable, match="gone"):
        launcher.run(["model", "prepare", str(tmp_path)], _env())
    # The fallback: `python -m stagemesh model prepare ...`, as without a launcher.
    assert prepare_models([str(tmp_path)], launcher=launcher) == {str(tmp_path): tmp_path}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="OpenBLAS starts no pool")
def test_a_launcher_running_threads_forks_nothing_and_serve_spawns(tmp_path: Path) -> None:
    # An operator's OpenBLAS setting that starts a thread pool when numpy loads.
    launcher = Launcher.start({**_env(), "OPENBLAS_NUM_THREADS": "2"})
    try:
        with pytest.raises(LauncherUnavailable, match="threads"):
            launcher.run(["model", "prepare", str(tmp_path)], _env())
        assert prepare_models([str(tmp_path)], launcher=launcher) == {str(tmp_path): tmp_path}
    finally:
        launcher.close()


def _ask(sock: socket.socket, message: bytes, fds: list[int] | None = None
         ) -> dict[str, object]:
    socket.send_fds(sock, [message], fds or [])
    assert select.select([sock], [], [], REPLY_S)[0], "no reply from the launcher"
    reply: dict[str, object] = json.loads(sock.recv(1 << 16))
    return reply


def test_the_protocol_refuses_bad_requests_and_goes_on(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = subprocess.Popen(
        [sys.executable, "-m", "stagemesh.launcher", "--fd", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),), env=_env())
    theirs.close()
    try:
        assert _ask(ours, b"not json\n")["id"] is None
        refused = _ask(ours, json.dumps({"id": 1, "argv": "stage", "env": {}}).encode())
        assert refused["id"] == 1 and "argv" in str(refused["error"])
        assert "env" in str(_ask(ours, json.dumps(
            {"id": 2, "argv": ["x"], "env": {"A": 1}}).encode())["error"])

        read_end, write_end = os.pipe()  # the child's stdout rides along with the request
        request = {"id": 3, "argv": ["model", "prepare", str(tmp_path)], "env": _env()}
        forked = _ask(ours, json.dumps(request).encode(), [write_end])
        os.close(write_end)
        assert forked["id"] == 3 and isinstance(forked["pid"], int)
        with open(read_end, "rb") as out:
            assert out.read() == f"{tmp_path}\n".encode()
        assert select.select([ours], [], [], REPLY_S)[0]
        assert json.loads(ours.recv(1 << 16)) == {"pid": forked["pid"], "returncode": 0}
        assert process.poll() is None  # alive after all of it
    finally:
        ours.close()  # the launcher's end closes: it exits
        assert process.wait(timeout=REPLY_S) == 0
