"""A burst of simultaneous stage calls over replicas: each call counts on its replica from the
moment it is picked, so calls that pick together (and then wait for a connection) spread over
the replicas; a load report read while our own calls end is not taken for other gateways'
load."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from stagemesh.gateway.mesh import balancer
from stagemesh.gateway.mesh.balancer import Replica, ReplicaSet
from stagemesh.gateway.recipes import parse_target
from stagemesh.shared.proto.v1 import control_service_pb2
from stagemesh.shared.server import open_channel


def _replicas(*in_flight: int) -> ReplicaSet:
    """Replicas on ports nothing listens on: a connection attempt waits, then fails."""
    replicas = ReplicaSet("dit", "x", parse_target("127.0.0.1:1"))
    replicas.replicas = [Replica(f"127.0.0.1:{i + 1}", open_channel(f"127.0.0.1:{i + 1}"), i,
                                 in_flight=load) for i, load in enumerate(in_flight)]
    return replicas


async def _burst(replicas: ReplicaSet, calls: int) -> Counter[str]:
    """`calls` stage calls at once, each picking its replica and then waiting for a connection
    (as `mesh.calls.call_stage` does); how many went to each replica."""

    async def call() -> str:
        replica = replicas.take()
        assert replica is not None
        try:
            await replicas.connect(replica, 0.5)
            return replica.address
        finally:
            replicas.release(replica)

    return Counter(await asyncio.gather(*(call() for _ in range(calls))))


async def test_four_simultaneous_calls_over_two_idle_replicas_split_two_and_two() -> None:
    replicas = _replicas(0, 0)
    assert await _burst(replicas, 4) == {"127.0.0.1:1": 2, "127.0.0.1:2": 2}
    assert [r.in_flight for r in replicas.replicas] == [0, 0]  # every call released
    await replicas.close()


async def test_a_burst_fills_the_less_loaded_replica_first_then_alternates() -> None:
    replicas = _replicas(2, 0)  # the first replica already runs two calls
    assert await _burst(replicas, 4) == {"127.0.0.1:1": 1, "127.0.0.1:2": 3}
    await replicas.close()


@pytest.mark.parametrize("ours_after", [0, 1])
async def test_a_load_report_read_while_our_calls_end_is_not_others_load(
        monkeypatch: pytest.MonkeyPatch, ours_after: int) -> None:
    replicas = _replicas(2)
    replica = replicas.replicas[0]

    async def health(channel: object, timeout: float) -> int:
        return 1  # SERVING

    async def load(channel: object) -> control_service_pb2.GetStageLoadResponse:
        report = control_service_pb2.GetStageLoadResponse(in_flight=2)  # our two calls
        replica.in_flight = ours_after  # ... which end before the report arrives
        return report

    monkeypatch.setattr(balancer, "health_status", health)
    monkeypatch.setattr(balancer, "_load", load)
    await replicas.poll()
    assert replica.others == 0
    await replicas.close()
