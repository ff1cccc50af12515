"""CancelScope: cancel-by-id lands wherever the request is (every open stage call, several
per stage for the images of one request), and never hangs."""

from __future__ import annotations

import asyncio

import pytest

from stagemesh.gateway.mesh.calls import (
    CancelScope,
    DeadlineExceeded,
    RequestCancelled,
    ScopeRegistry,
    SendCancel,
    side_by_side,
    stage_request_id,
    sub_request_ids,
)
from stagemesh.gateway.wire.auth import owner_id
from stagemesh.shared.limits import (
    MAX_REQUEST_ID_CHARS,
    MAX_STAGE_REQUEST_ID_CHARS,
    OWNER_ID_CHARS,
    REQUEST_ID_PATTERN,
)
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
    left = CancelScope("r", timeout=5).remaining()
    assert left is not None and 0 < left <= 5
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


async def test_every_open_call_gets_the_cancel_and_the_first_ack_answers() -> None:
    scope = CancelScope("r", timeout=None, parts=3)
    sent: list[str] = []

    def stage_call(name: str, step: int, delay: float) -> SendCancel:
        async def send_cancel(reason: str) -> None:
            sent.append(name)
            asyncio.get_running_loop().call_later(
                delay, scope.acknowledge, "dit", common_pb2.Aborted(step_index=step))
        return send_cancel

    calls = [scope.enter_stage("dit", stage_call(f"dit-{i}", i + 1, 0.01 * (3 - i)))
             for i in range(3)]
    assert scope.open_stages == ["dit", "dit", "dit"]  # three calls to one stage, all held
    outcome = await scope.cancel("user")
    assert sorted(sent) == ["dit-0", "dit-1", "dit-2"]
    assert outcome.step_index == 3  # the quickest ack (image 2's) is the answer
    scope.leave_stage(calls[1])
    scope.leave_stage(calls[1])  # leaving twice is harmless
    assert scope.open_stages == ["dit", "dit"]


async def test_a_call_that_cannot_take_the_cancel_does_not_keep_it_from_the_others() -> None:
    scope = CancelScope("r", timeout=None)
    sent: list[str] = []

    async def ended(reason: str) -> None:
        raise RuntimeError("the stream just ended")

    async def running(reason: str) -> None:
        sent.append(reason)
        scope.acknowledge("vae", common_pb2.Aborted(step_index=1))

    scope.enter_stage("vae", ended)
    scope.enter_stage("vae", running)
    assert (await scope.cancel("user")).stage == "vae" and sent == ["user"]


def test_sub_ids_name_each_part_and_a_single_part_keeps_the_id() -> None:
    assert sub_request_ids("job", 1) == ["job"]
    assert sub_request_ids("job", 3) == ["job.0", "job.1", "job.2"]
    assert CancelScope("job", None, parts=2).sub_request_ids == ["job.0", "job.1"]


def test_registry_refuses_an_id_too_long_to_suffix() -> None:
    registry = ScopeRegistry()
    longest = "x" * MAX_REQUEST_ID_CHARS
    registry.close(registry.open(longest, None))  # one part: the id as it is
    with pytest.raises(ValueError, match=f"longer than {MAX_REQUEST_ID_CHARS - 2} characters"):
        registry.open(longest, None, parts=4)  # ".3" would not fit
    scope = registry.open(longest[:-2], None, parts=4)
    assert max(map(len, scope.sub_request_ids)) == MAX_REQUEST_ID_CHARS


def test_registry_keeps_a_live_requests_sub_ids_for_it() -> None:
    registry = ScopeRegistry()
    scope = registry.open("a", None, parts=2)
    with pytest.raises(KeyError):
        registry.open("a.1", None)  # the DiT already runs a.1 for request a
    assert registry.get("a.1") is None  # cancel-by-id knows requests, not their parts
    registry.close(scope)
    registry.close(registry.open("a.1", None))


OWNER_A, OWNER_B = owner_id("sk-a"), owner_id("sk-b")


def test_two_owners_hold_the_same_id_apart_and_one_owner_holds_it_once() -> None:
    registry = ScopeRegistry()
    mine, theirs = registry.open("x", None, owner=OWNER_A), registry.open("x", None, owner=OWNER_B)
    with pytest.raises(KeyError):
        registry.open("x", None, owner=OWNER_A)
    assert registry.get("x", OWNER_A) is mine and registry.get("x", OWNER_B) is theirs
    assert registry.get("x") is None  # nor does API keys off find a keyed request
    assert mine.request_id == theirs.request_id == "x"
    assert mine.stage_request_id != theirs.stage_request_id  # the stages keep them apart
    registry.close(theirs)
    assert registry.get("x", OWNER_B) is None and registry.get("x", OWNER_A) is mine
    registry.close(registry.open("x", None, owner=OWNER_B))  # free again for B alone
    with pytest.raises(KeyError):
        registry.open("x", None, owner=OWNER_A)


def test_the_stages_know_an_owners_request_by_its_qualified_id() -> None:
    assert stage_request_id("job", "") == "job"  # API keys off: the wire is unchanged
    assert stage_request_id("job", OWNER_A) == f"job:{OWNER_A}"
    scope = CancelScope("job", None, parts=2, owner=OWNER_A)
    assert scope.request_id == "job"
    assert scope.sub_request_ids == [f"job:{OWNER_A}.0", f"job:{OWNER_A}.1"]
    with pytest.raises(ValueError, match="owner id"):
        stage_request_id("job", "k" * (OWNER_ID_CHARS + 1))


def test_the_longest_qualified_ids_fit_the_stages_limit() -> None:
    assert len(OWNER_A) == OWNER_ID_CHARS  # every API key's owner id has this length
    registry = ScopeRegistry()
    for parts in (1, 4):
        longest = "x" * (MAX_REQUEST_ID_CHARS - (2 if parts > 1 else 0))
        scope = registry.open(longest, None, parts=parts, owner=OWNER_A)
        assert max(len(rid) for rid in [scope.stage_request_id, *scope.sub_request_ids]) <= (
            MAX_STAGE_REQUEST_ID_CHARS)
        assert all(REQUEST_ID_PATTERN.fullmatch(rid) for rid in scope.sub_request_ids)
        registry.close(scope)


def test_an_owners_ids_never_meet_another_owners_at_the_stages() -> None:
    """A client id that spells another owner's qualified id stays apart from it."""
    registry = ScopeRegistry()
    registry.open("a", None, parts=2, owner=OWNER_A)  # the stages run a:<A>.0 and a:<A>.1
    for owner, request_id in ((OWNER_B, f"a:{OWNER_A}.1"), (OWNER_B, f"a:{OWNER_A}"),
                              (OWNER_A, "a.1")):
        scope = registry.open(request_id, None, owner=owner)
        assert scope.stage_request_id not in {f"a:{OWNER_A}", f"a:{OWNER_A}.0", f"a:{OWNER_A}.1"}
    with pytest.raises(KeyError):  # unqualified (keys off), that id is the stages' already
        registry.open(f"a:{OWNER_A}.0", None)


async def test_side_by_side_raises_the_first_failure_and_cancels_the_others() -> None:
    cancelled: list[int] = []

    async def wait_forever(index: int) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(index)
            raise

    async def fail() -> None:
        await asyncio.sleep(0)
        raise RequestCancelled(CancelScope("r", None).acknowledge("dit", common_pb2.Aborted()))

    with pytest.raises(RequestCancelled):  # itself, not an ExceptionGroup
        async with side_by_side() as group:
            for index in range(2):
                group.create_task(wait_forever(index))
            group.create_task(fail())
    assert sorted(cancelled) == [0, 1]
