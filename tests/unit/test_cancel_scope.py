"""CancelScope: cancel-by-id lands wherever the request is, and never hangs."""

from __future__ import annotations

import asyncio

import pytest

from stagemesh.gateway.cancel import CancelScope, DeadlineExceeded, RequestCancelled, ScopeRegistry
from stagemesh.shared.proto.v1 import common_pb2


async def test_cancel_inside_a_stage_waits_for_the_stages_ack() -> None:
    scope = CancelScope("r", timeout=None)
    sent: list[str] = []

    async def send_cancel(reason: str) -> None:
        sent.append(reason)
        # the stage answers with its Aborted event a little later
        asyncio.get_running_loop().call_later(0.01, scope.acknowledge, "dit",
                                              common_pb2.Aborted(step_index=4,
                                                                 abort_latency_seconds=0.02))

    scope.enter_stage("dit", send_cancel)
    outcome = await scope.cancel("user")
    assert sent == ["user"]
    assert (outcome.stage, outcome.step_index, outcome.state) == (
        "dit", 4, common_pb2.REQUEST_STATE_ABORTED)
    assert outcome.abort_latency_seconds == pytest.approx(0.02)


async def test_cancel_between_stages_stops_the_next_stage_before_it_runs() -> None:
    scope = CancelScope("r", timeout=None)
    canceller = asyncio.create_task(scope.cancel("user"))
    await asyncio.sleep(0)
    with pytest.raises(RequestCancelled):
        scope.enter_stage("vae", lambda reason: asyncio.sleep(0))
    outcome = await canceller
    assert outcome.stage == "vae" and outcome.state == common_pb2.REQUEST_STATE_ABORTED


async def test_a_request_that_completes_first_reports_succeeded() -> None:
    scope = CancelScope("r", timeout=None)
    canceller = asyncio.create_task(scope.cancel("user"))
    await asyncio.sleep(0)
    scope.settle(common_pb2.REQUEST_STATE_SUCCEEDED)
    assert (await canceller).state == common_pb2.REQUEST_STATE_SUCCEEDED


async def test_a_second_cancel_returns_the_same_outcome() -> None:
    scope = CancelScope("r", timeout=None)
    scope.acknowledge("dit", common_pb2.Aborted(step_index=2))
    assert (await scope.cancel("again")).step_index == 2


def test_remaining_budget_and_its_end() -> None:
    assert CancelScope("r", timeout=None).remaining() is None
    assert 0 < CancelScope("r", timeout=5).remaining() <= 5
    with pytest.raises(DeadlineExceeded):
        CancelScope("r", timeout=-1).remaining()


def test_registry_refuses_duplicate_and_oversized_ids() -> None:
    registry = ScopeRegistry()
    scope = registry.open("a", None)
    with pytest.raises(KeyError):
        registry.open("a", None)
    with pytest.raises(ValueError, match="longer"):
        registry.open("x" * 200, None)
    assert registry.get("a") is scope
    registry.close(scope)
    assert registry.get("a") is None
    assert registry.open(None, None).request_id.startswith("req-")
