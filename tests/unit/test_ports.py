"""Free ports come from below the kernel's ephemeral range (shared/ports.py), where no outgoing
connection's local port can take one between the probe and the stage's bind; a port taken
meanwhile is not handed out; without room below the range the kernel chooses."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stagemesh.shared import ports


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    start = ports._ephemeral_start()
    if start - ports.LOWEST <= ports.TRIES:
        pytest.skip(f"this kernel's ephemeral range starts at {start}: no room below it")
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < start
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed


def test_no_port_is_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mesh's stage ports are all probed before any stage binds one."""
    picks = iter([20001, 20001, 20002])

    class Scripted:
        def randrange(self, low: int, high: int) -> int:
            return next(picks)

    monkeypatch.setattr(ports, "_random", Scripted())
    monkeypatch.setattr(ports, "_handed", set())
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 32768)
    assert [ports.free_port(), ports.free_port()] == [20001, 20002]


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        tries = iter([taken, taken])

        class Scripted:
            def randrange(self, low: int, high: int) -> int:
                return next(tries, taken + 1 if taken + 1 < high else low)

        monkeypatch.setattr(ports, "_random", Scripted())
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: max(taken + 2, ports.LOWEST + 100))
        assert ports.free_port() != taken


def test_without_room_below_the_range_the_kernel_chooses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kernels = ports._ephemeral_start()  # where the kernel's choice really comes from
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{ports.LOWEST + 10}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", narrow)
    port = ports.free_port()
    assert port >= kernels  # bind(0): the kernel's ephemeral range, not a random try
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
