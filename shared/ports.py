"""Free TCP ports for processes this machine starts (stages on `--stage-ports auto`, a DiT
group's rendezvous, tests and benchmarks).

A port is looked for below the kernel's ephemeral range (Linux: 32768-60999 by default), not
asked of the kernel with bind(0): bind(0) hands out a port from that very range, from which
the kernel also picks every outgoing connection's local port, so between the probe and the
stage's own bind a gRPC or HTTP client on the machine could take it ("Address already in
use" at start-up, seen in CI and in benches).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The lowest port handed out (below are well-known and registered services' ports).
LOWEST = 10000
#: Where Linux says its ephemeral range starts; 32768 when it cannot be read.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Ports tried at random before falling back to the kernel's choice.
TRIES = 64

_random = random.SystemRandom()  # not the `random` module's state: a test may seed that
#: Every port this process handed out: a caller probes several before any is bound (all of a
#: mesh's stage ports), so a random pick must not repeat one.
_handed: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, below the ephemeral range where there is room."""
    high = _ephemeral_start()
    if high - LOWEST > TRIES:
        for _ in range(TRIES):
            port = _random.randrange(LOWEST, high)
            if port in _handed:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
                _handed.add(port)
                return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
