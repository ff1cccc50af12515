"""A replica's channel closed under a poll (the balancer replaces a failed channel and closes the
old one) cancels the poll's health and load calls though nobody cancelled the poller: the poll
reads the replica as unreachable and the polling goes on; a poller that is itself cancelled
still stops. The stages listing, which asks every replica's health itself, reads it the same
way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.mesh.balancer import Replica, ReplicaSet, ReplicaState
from stagemesh.gateway.mesh.stages import Mesh, StageCatalog
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task, parse_target
from stagemesh.shared.server import open_channel


class _NeverAnswers(grpc.GenericRpcHandler):
    """Every call (health, load) waits for ever: the poll is in flight when the channel closes."""

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        async def wait(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await asyncio.Event().wait()
            return b""

        return grpc.unary_unary_rpc_method_handler(wait)


@pytest_asyncio.fixture
async def silent_replica() -> AsyncIterator[ReplicaSet]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_NeverAnswers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    replicas = ReplicaSet("dit", address, parse_target(address))
    replicas.replicas = [Replica(address, open_channel(address), 0)]
    yield replicas
    await replicas.close()
    await server.stop(0)


async def _in_flight(replicas: ReplicaSet) -> asyncio.Task[None]:
    polling = asyncio.create_task(replicas.poll())
    await asyncio.sleep(0.3)  # the health and load calls are open on the server
    assert not polling.done()
    return polling


async def test_a_channel_closed_under_a_poll_reads_as_unreachable(
        silent_replica: ReplicaSet) -> None:
    polling = await _in_flight(silent_replica)
    await silent_replica.replicas[0].channel.close()
    await asyncio.wait_for(polling, 5)  # no CancelledError out of the poll
    assert silent_replica.replicas[0].state is ReplicaState.UNREACHABLE


async def test_a_cancelled_poller_still_stops(silent_replica: ReplicaSet) -> None:
    polling = await _in_flight(silent_replica)
    polling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await polling


async def test_stage_rows_read_while_a_replica_is_replaced_are_one_moment() -> None:
    """GET /v1/stages while the balancer replaces a failed replica (its channel closed, the
    set changed): every row is the replica that was asked, read as unreachable — no
    CancelledError and no rows paired with the wrong endpoints (both were 500s)."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_NeverAnswers(),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    mesh = Mesh({"whisper": Recipe(
        name="whisper", task=Task.SPEECH_TO_TEXT, model="w",
        stages={"transcriber": StageEndpoint("transcriber", address)})})
    await mesh.start()
    core = GatewayCore(mesh, StageCatalog(mesh))
    try:
        listing = asyncio.create_task(core.stage_infos())
        await asyncio.sleep(0.3)  # the health check is open on the server
        replicas = mesh.replica_set(mesh.recipes["whisper"].stage("transcriber"))
        replaced = replicas.replicas[0]
        # as the balancer's _reconnect_if_failed does: a fresh channel, the old one's watcher
        # stopped, then the old one closed
        old, replaced.channel = replaced.channel, open_channel(address)
        replicas._watchers.pop(replaced).cancel()
        replicas.replicas.append(Replica(address, open_channel(address), 1))  # the set grew
        await old.close()
        infos = await asyncio.wait_for(listing, 10)
        assert [(info.name, info.address, info.health) for info in infos] == [
            ("transcriber", address, "UNREACHABLE")]
    finally:
        await mesh.close()
        await server.stop(0)
