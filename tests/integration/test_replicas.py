"""Two real DiT replicas (the tiny model, in this process) behind one stage address, and two
gateways over the same stages: load spread, a refused start retried on the other replica, a
dead replica, drain, and cancel by id from the gateway that does not run the request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.images.pipeline import GeneratedImage, generate_images, prepare_images
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.gateway.mesh.balancer import (
    HEALTH_CHECK,
    Replica,
    ReplicaSet,
    ReplicaState,
    RoutedStreamStream,
)
from stagemesh.gateway.mesh.calls import CancelScope, StageCallError, call_stage
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task, parse_target
from stagemesh.services.registry import build_stage
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.errors import StageError, parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2, tokenizer_service_pb2
from stagemesh.shared.server import open_channel
from stagemesh.shared.stage_runtime import (
    FLUSH_GRACE_S,
    Ending,
    drain_stage,
    start_stage,
    stop_stage,
    until_stopped,
)

from .conftest import RunningStage

pytestmark = pytest.mark.timeout(120)

DIT_OPTIONS = {"max_steps": 1000, "max_batch": 1}
LONG = 1000  # steps: runs until cancelled


@pytest.fixture
async def stages(tiny_model_dir: Path) -> AsyncIterator[dict[str, RunningStage]]:
    """tokenizer, dit_a, dit_b, vae: every one a real stage server on a free port."""
    running: dict[str, RunningStage] = {}
    for key, name in (("tokenizer", "tokenizer"), ("dit_a", "dit"), ("dit_b", "dit"),
                      ("vae", "vae")):
        bundle = build_stage(name, tiny_model_dir, DIT_OPTIONS if name == "dit" else None)
        running[key] = RunningStage(bundle, await start_stage(bundle))
    yield running
    for stage in running.values():
        with contextlib.suppress(Exception):
            await stop_stage(stage.bundle, stage.server, grace=0.5)


def _recipe(stages: dict[str, RunningStage], model_dir: Path) -> Recipe:
    dit = f"ipv4:{stages['dit_a'].address},{stages['dit_b'].address}"
    return Recipe(name="tiny", task=Task.TEXT_TO_IMAGE, model=str(model_dir), stages={
        "tokenizer": StageEndpoint("tokenizer", stages["tokenizer"].address),
        "dit": StageEndpoint("dit", dit),
        "vae": StageEndpoint("vae", stages["vae"].address)},
        image_defaults=ImageDefaults(width=32, height=32, num_inference_steps=4))


@pytest.fixture
async def gateways(stages: dict[str, RunningStage], tiny_model_dir: Path
                   ) -> AsyncIterator[tuple[GatewayCore, GatewayCore]]:
    """Two gateways (as two gateway replicas would be) over the same stages."""
    recipes = {"tiny": _recipe(stages, tiny_model_dir)}
    async with open_gateway(recipes) as first, open_gateway(recipes) as second:
        yield first, second


def _dit(stage: RunningStage) -> StepEngine[Any, Any, Any, Any, Any]:
    engine = stage.bundle.engines[0]
    assert isinstance(engine, StepEngine)
    return engine


async def _image(core: GatewayCore, request_id: str | None = None, steps: int = 4,
                 seed: int = 0, owner: str = "") -> list[GeneratedImage]:
    job = await prepare_images(core, ImageRequest(prompt="a red circle", seed=seed,
                                                 num_inference_steps=steps))
    return await generate_images(core, job, RequestContext.create(request_id, 120, owner))


def _steps(stage: RunningStage) -> Callable[[], bool]:
    """Whether the replica's DiT is running a request."""
    return lambda: _dit(stage).num_running > 0


def _both_running(stages: dict[str, RunningStage]) -> Callable[[], bool]:
    return lambda: _dit(stages["dit_a"]).num_running == _dit(stages["dit_b"]).num_running == 1


def _stepped(stages: dict[str, RunningStage]) -> Callable[[], bool]:
    """Whether every request on the DiT replicas has completed a step (the engines' own
    bookkeeping: no event says it to the gateway's caller)."""
    def stepped(engine: StepEngine[Any, Any, Any, Any, Any]) -> bool:
        records = [engine._scheduler.get(rid) for rid in list(engine._streams)]
        return all(record is not None and record.step_index > 0 for record in records)
    return lambda: all(stepped(_dit(stages[key])) for key in ("dit_a", "dit_b"))


async def test_a_start_refused_by_a_draining_replica_runs_on_the_other(
        gateways: tuple[GatewayCore, GatewayCore], stages: dict[str, RunningStage]) -> None:
    core, _ = gateways
    refusing = _dit(stages["dit_a"])
    await asyncio.to_thread(refusing.shutdown, False, 5.0)  # admits nothing; health unchanged
    images = await asyncio.gather(*(_image(core, seed=i) for i in range(4)))
    assert len(images) == 4
    replicas = core.mesh.replica_set(core.recipes["tiny"].stage("dit"))
    states = {replica.address: replica.state for replica in replicas.replicas}
    assert states[stages["dit_a"].address].value == "NOT_SERVING"  # it was tried, and refused


async def test_a_replica_that_dies_fails_its_requests_at_once_and_the_other_serves(
        gateways: tuple[GatewayCore, GatewayCore], stages: dict[str, RunningStage],
        wait_until: Callable[..., Any]) -> None:
    core, _ = gateways
    runs = {f"dies-{i}": asyncio.create_task(_image(core, f"dies-{i}", steps=300, seed=i))
            for i in range(2)}
    await wait_until(_both_running(stages), what="one request running on each DiT replica")
    await stages["dit_a"].server.server.stop(0)  # the replica is gone, mid-request
    done, _ = await asyncio.wait(runs.values(), timeout=5, return_when=asyncio.FIRST_COMPLETED)
    failed_run = done.pop()
    failed = failed_run.exception()
    assert isinstance(failed, GatewayError) and failed.code is grpc.StatusCode.UNAVAILABLE
    assert f"dit stage at {stages['dit_a'].address}" in str(failed)
    assert len(await _image(core, seed=5, steps=2)) == 1  # new requests go to the survivor
    (other,) = [run for run in runs.values() if run is not failed_run]
    assert len(await other) == 1  # the request on the other replica completes


async def test_a_draining_replica_finishes_its_requests_and_takes_no_new_ones(
        gateways: tuple[GatewayCore, GatewayCore], stages: dict[str, RunningStage],
        wait_until: Callable[..., Any]) -> None:
    core, _ = gateways
    runs = [asyncio.create_task(_image(core, seed=i, steps=40)) for i in range(2)]
    await wait_until(_steps(stages["dit_a"]), what="a request running on replica a")
    drained = asyncio.create_task(drain_stage(stages["dit_a"].bundle, stages["dit_a"].server,
                                              grace=60))
    later = [asyncio.create_task(_image(core, seed=10 + i)) for i in range(3)]
    assert all(len(images) == 1 for images in await asyncio.gather(*runs, *later))
    assert await drained  # every admitted request finished within the grace period


async def _start_on(channel: grpc.aio.Channel, request_id: str) -> StageError:
    """Send a start to a draining tokenizer; the status its stream ends with."""
    encode = channel.stream_stream(
        "/stagemesh.v1.TokenizerService/EncodePrompt",
        request_serializer=tokenizer_service_pb2.EncodePromptRequest.SerializeToString,
        response_deserializer=tokenizer_service_pb2.EncodePromptResponse.FromString)
    call = encode(timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await call.write(tokenizer_service_pb2.EncodePromptRequest(
            start=tokenizer_service_pb2.EncodePromptStart(request_id=request_id, prompt="late")))
        async for response in call:
            raise AssertionError(f"a draining stage answered {response}")
    return parse_rpc_error(ended.value)


async def test_a_draining_stage_refuses_starts_until_they_stop_coming_then_stops(
        stages: dict[str, RunningStage], wait_until: Callable[..., Any]) -> None:
    """Gateways that have not yet polled its NOT_SERVING health still send it starts: each gets
    a refusal they retry on another replica (UNAVAILABLE, DRAINING), never a stream cut by the
    server's stop (CANCELLED), though its idle engines stopped at once."""
    stage = stages["tokenizer"]
    channel = open_channel(stage.address)
    try:
        await channel.channel_ready()
        drained = asyncio.create_task(drain_stage(stage.bundle, stage.server, grace=5))
        await wait_until(lambda: all(engine.stopped for engine in stage.bundle.engines),
                         what="the idle engines stopped")
        ends = []
        for i in range(3):
            ends.append(await _start_on(channel, f"late-{i}"))
            await asyncio.sleep(0.1)
        assert {(end.code, end.reason) for end in ends} == {
            (grpc.StatusCode.UNAVAILABLE, "DRAINING")}, ends
        assert await asyncio.wait_for(drained, FLUSH_GRACE_S + 5)
    finally:
        await channel.close()


class _Replica:
    """A tokenizer replica that answers every stream the same way (`queued` first, when
    `accept`), then a result, or `cut` (the status gRPC gives a stream that reaches a server as
    it stops); it counts the starts it got."""

    def __init__(self, *, accept: bool, cut: bool) -> None:
        self.accept, self.cut, self.starts = accept, cut, 0
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "stagemesh.v1.TokenizerService", {"EncodePrompt": grpc.stream_stream_rpc_method_handler(
                self._encode,
                request_deserializer=tokenizer_service_pb2.EncodePromptRequest.FromString,
                response_serializer=tokenizer_service_pb2.EncodePromptResponse.SerializeToString,
            )}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def _encode(self, requests: AsyncIterator[tokenizer_service_pb2.EncodePromptRequest],
                      context: grpc.aio.ServicerContext[Any, Any]
                      ) -> AsyncIterator[tokenizer_service_pb2.EncodePromptResponse]:
        await anext(requests)
        self.starts += 1
        if self.accept:
            yield tokenizer_service_pb2.EncodePromptResponse(queued=common_pb2.Queued())
        if self.cut:
            await context.abort(grpc.StatusCode.CANCELLED, "cancelled by the server's stop")
        yield tokenizer_service_pb2.EncodePromptResponse(
            result=tokenizer_service_pb2.EncodePromptResult())


Encoded = tokenizer_service_pb2.EncodePromptResponse | StageCallError


async def _encode_on(first: _Replica, second: _Replica) -> tuple[Encoded, ReplicaState]:
    """One stage call over the two replicas, `first` picked first: its response (or error),
    and what the balancer then thinks of `first`."""
    await first.server.start()
    await second.server.start()
    replicas = ReplicaSet("tokenizer", "two", parse_target("127.0.0.1:1"))
    replicas.replicas = [Replica(r.address, open_channel(r.address), i)
                         for i, r in enumerate((first, second))]
    rpc = RoutedStreamStream(
        replicas, "/stagemesh.v1.TokenizerService/EncodePrompt",
        tokenizer_service_pb2.EncodePromptRequest.SerializeToString,
        tokenizer_service_pb2.EncodePromptResponse.FromString)
    start = tokenizer_service_pb2.EncodePromptRequest(
        start=tokenizer_service_pb2.EncodePromptStart(request_id="r1", prompt="a cat"))
    try:
        outcome: Encoded = await call_stage(CancelScope("r1", 10), "tokenizer", rpc, start,
                                            tokenizer_service_pb2.EncodePromptRequest)
    except StageCallError as failed:
        outcome = failed
    finally:
        first_state = replicas.replicas[0].state
        await replicas.close()
        await first.server.stop(0)
        await second.server.stop(0)
    return outcome, first_state


async def test_a_start_cut_by_a_stopping_replica_before_it_was_accepted_runs_on_another() -> None:
    stopping, serving = _Replica(accept=False, cut=True), _Replica(accept=False, cut=False)
    response, stopping_state = await _encode_on(stopping, serving)
    assert not isinstance(response, StageCallError), response
    assert response.WhichOneof("event") == "result"
    assert (stopping.starts, serving.starts) == (1, 1)
    assert stopping_state is ReplicaState.NOT_SERVING  # nothing new until a poll says SERVING


async def test_a_stream_cut_after_the_replica_accepted_it_is_not_run_again() -> None:
    cut, other = _Replica(accept=True, cut=True), _Replica(accept=False, cut=False)
    failed, _ = await _encode_on(cut, other)
    assert isinstance(failed, StageCallError)
    assert failed.error.code is grpc.StatusCode.CANCELLED
    assert (cut.starts, other.starts) == (1, 0)  # never on two replicas


async def test_requests_spread_over_the_replicas_and_any_gateway_cancels_them(
        gateways: tuple[GatewayCore, GatewayCore], stages: dict[str, RunningStage],
        wait_until: Callable[..., Any]) -> None:
    first, second = gateways
    runs = {f"far-{i}": asyncio.create_task(_image(first, f"far-{i}", steps=LONG, seed=i,
                                                   owner="key-a")) for i in range(2)}
    await wait_until(_both_running(stages), what="one request running on each DiT replica")
    await wait_until(_stepped(stages), what="a step of each request")  # then cancel
    with pytest.raises(GatewayError) as foreign:  # another API key's cancel: not found
        await second.cancel("far-0", owner="key-b")
    assert foreign.value.code is grpc.StatusCode.NOT_FOUND and not runs["far-0"].done()
    for request_id, run in runs.items():  # sent to the gateway that does not run them
        outcome = await second.cancel(request_id, owner="key-a")
        assert (outcome.stage, outcome.state) == ("dit", common_pb2.REQUEST_STATE_ABORTED)
        assert 0 < outcome.step_index < LONG and outcome.abort_latency_seconds < 5
        with pytest.raises(GatewayError) as cancelled:
            await run
        assert cancelled.value.code is grpc.StatusCode.CANCELLED
    images = await asyncio.gather(*(_image(first, seed=i) for i in range(4)))
    assert all(len(batch) == 1 and batch[0].png for batch in images)

    with pytest.raises(GatewayError) as unknown:  # a cancel before its request: pending
        await second.cancel("early")
    assert unknown.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(GatewayError) as dropped:
        await _image(first, "early")
    assert dropped.value.code is grpc.StatusCode.CANCELLED
    assert len(await _image(first, "early", owner="someone-else")) == 1  # not theirs


async def test_a_stage_whose_engine_thread_stops_reports_not_serving_and_exits(
        tiny_model_dir: Path) -> None:
    bundle = build_stage("vae", tiny_model_dir)
    server = await start_stage(bundle)
    try:
        watching = asyncio.create_task(until_stopped(bundle, server))
        await asyncio.to_thread(bundle.engines[0].shutdown, True, 5.0)  # the thread is gone
        assert await asyncio.wait_for(watching, 10) is Ending.ENGINE_DIED  # exit status 1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            check = channel.unary_unary(
                HEALTH_CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString)
            reply = await check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await stop_stage(bundle, server, grace=0.5)
