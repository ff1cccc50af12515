"""A DiT stage served by a group of ranks keeps every promise of a one-device stage.

One module-scoped stage (parallel_cfg 2 x parallel_ulysses 2: this process is rank 0, three
worker processes, 1 thread each; int8 weights, which every rank quantizes alike) serves every
test over gRPC, its results compared with one int8 device; the last test kills one of its ranks,
so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.gateway.mesh.stages import publish_into
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.dit.parallel import GroupForward, stop_group
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    dit_service_pb2_grpc,
    gateway_service_pb2,
)
from stagemesh.shared.quantization import Quantization, quantize
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import (
    Ending,
    StageBundle,
    start_stage,
    stop_stage,
    until_stopped,
)
from stagemesh.shared.torch_tensors import from_proto, to_proto
from tests.model.test_dit_batching import TOLERANCE, Job, _solo

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

#: max_batch 2: a third request waits, a more urgent one preempts.
OPTIONS = {"parallel_cfg": 2, "parallel_ulysses": 2, "max_batch": 2, "max_running": 3,
           "quantization": "int8"}
SIZE = 64


@dataclass
class Group:
    bundle: StageBundle
    server: RunningServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def pids(self) -> list[int]:
        return [int(pid) for pid in self.bundle.info["group_pids"].split()]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group(tiny_model_dir: Path) -> AsyncIterator[Group]:
    bundle = build_stage("dit", tiny_model_dir, OPTIONS)
    served = Group(bundle, await start_stage(bundle))
    yield served
    await stop_stage(bundle, served.server, grace=0.5)
    # a stage process's workers die with it; this one (pytest) lives on
    group: GroupForward = vars(bundle.engines[0])["_adapter"].group
    assert group.workers is not None
    stop_group(group, group.workers)


@pytest.fixture(scope="module")
def one_device(tiny_model_dir: Path) -> DenoiseAdapter:
    adapter = DenoiseAdapter(tiny_model_dir)
    quantize(adapter.transformer.transformer_blocks, Quantization.INT8)
    return adapter


def _dim(model_dir: Path) -> int:
    config = json.loads((model_dir / "transformer" / "config.json").read_text())
    return int(config["joint_attention_dim"])


def _input(dim: int, seed: int, *, steps: int, guided: bool, tokens: int = 5) -> DenoiseInput:
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, tokens, dim, generator=generator)
    negative = torch.randn(1, 4, dim, generator=generator) if guided else None
    return DenoiseInput(PromptEmbeddings(embeds, None, negative, None), SIZE, SIZE, steps,
                        4.0 if guided else 1.0, seed)


def _start(rid: str, payload: DenoiseInput, priority: int) -> dit_service_pb2.DenoiseRequest:
    emb = payload.embeddings
    start = dit_service_pb2.DenoiseStart(
        request_id=rid, prompt_embeds=to_proto(emb.prompt_embeds), height=payload.height,
        width=payload.width, num_inference_steps=payload.num_inference_steps,
        true_cfg_scale=payload.true_cfg_scale, seed=payload.seed, priority=priority)
    if emb.negative_prompt_embeds is not None:
        start.negative_prompt_embeds.CopyFrom(to_proto(emb.negative_prompt_embeds))
    return dit_service_pb2.DenoiseRequest(start=start)


async def _denoise(address: str, rid: str, payload: DenoiseInput,
                   on_progress: Callable[[Any, int], Any] | None = None, priority: int = 0,
                   kinds: list[str] | None = None) -> Any:
    """The stream's terminal event (result or aborted); `kinds` gets every event's kind."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = dit_service_pb2_grpc.DitServiceStub(channel).Denoise()
        await call.write(_start(rid, payload, priority))
        async for response in call:
            kind = response.WhichOneof("event")
            if kinds is not None:
                kinds.append(kind)
            if kind == "progress" and on_progress is not None:
                await on_progress(call, response.progress.step_index)
            if kind in ("result", "aborted"):
                return response
    raise AssertionError(f"{rid}: the stream ended without a terminal event")


async def test_describe_publishes_the_group(group: Group) -> None:
    async with grpc.aio.insecure_channel(group.address) as channel:
        described = await dit_service_pb2_grpc.DitServiceStub(channel).DescribeDit(
            dit_service_pb2.DescribeDitRequest())
    assert (described.parallel_cfg, described.parallel_ulysses) == (2, 2)
    assert list(described.group_devices) == ["cpu"] * 4
    assert described.quantization == "int8"
    assert len(group.pids) == 3
    # the gateway's /v1/stages row of this stage shows the group as Describe publishes it
    row = gateway_service_pb2.StageInfo(name="dit")
    publish_into(row, described)
    assert (row.parallel_cfg, row.parallel_ulysses) == (2, 2)
    assert list(row.group_devices) == ["cpu"] * 4


async def test_a_mixed_batch_equals_one_device(group: Group, one_device: DenoiseAdapter,
                                               tiny_model_dir: Path) -> None:
    dim = _dim(tiny_model_dir)
    payloads = {
        "guided": _input(dim, 1, steps=3, guided=True),
        "unguided": _input(dim, 2, steps=2, guided=False, tokens=7),
        "guided-long": _input(dim, 3, steps=4, guided=True, tokens=9),
    }
    results = await asyncio.gather(*(_denoise(group.address, rid, payload)
                                     for rid, payload in payloads.items()))
    for (rid, payload), response in zip(payloads.items(), results, strict=True):
        assert response.WhichOneof("event") == "result", rid
        want = await asyncio.to_thread(_solo, one_device, Job(rid, payload))
        got = from_proto(response.result.latents)
        assert (got - want).abs().max().item() <= TOLERANCE, rid


async def test_cancel_in_a_batch_stops_one_row_at_the_step_boundary(
        group: Group, one_device: DenoiseAdapter, tiny_model_dir: Path) -> None:
    dim = _dim(tiny_model_dir)
    kept, cancelled = _input(dim, 4, steps=5, guided=True), _input(dim, 5, steps=5, guided=True)

    async def cancel_at_2(call: Any, step: int) -> None:
        if step == 2:
            await call.write(dit_service_pb2.DenoiseRequest(cancel=common_pb2.Cancel()))

    done, aborted = await asyncio.gather(
        _denoise(group.address, "kept", kept),
        _denoise(group.address, "cancelled", cancelled, cancel_at_2))
    assert aborted.WhichOneof("event") == "aborted"
    assert aborted.aborted.reason == common_pb2.ABORT_REASON_CANCELLED
    assert 2 <= aborted.aborted.step_index < 5
    want = await asyncio.to_thread(_solo, one_device, Job("kept", kept))
    assert (from_proto(done.result.latents) - want).abs().max().item() <= TOLERANCE


async def test_a_lone_request_cancelled_mid_run_stops_every_rank(
        group: Group, one_device: DenoiseAdapter, tiny_model_dir: Path) -> None:
    """The whole batch cancelled: the engine interrupts the forward (every rank votes, block by
    block), the request ends aborted where it was, and the group serves on in step."""
    dim = _dim(tiny_model_dir)

    async def cancel_at_2(call: Any, step: int) -> None:
        if step == 2:
            await call.write(dit_service_pb2.DenoiseRequest(cancel=common_pb2.Cancel()))

    aborted = await _denoise(group.address, "alone", _input(dim, 8, steps=40, guided=True),
                             cancel_at_2)
    assert aborted.WhichOneof("event") == "aborted"
    assert aborted.aborted.reason == common_pb2.ABORT_REASON_CANCELLED
    assert 2 <= aborted.aborted.step_index < 40
    after = _input(dim, 9, steps=2, guided=False)
    done = await _denoise(group.address, "after", after)
    want = await asyncio.to_thread(_solo, one_device, Job("after", after))
    assert (from_proto(done.result.latents) - want).abs().max().item() <= TOLERANCE


async def test_an_urgent_request_preempts_a_row_of_the_group(
        group: Group, one_device: DenoiseAdapter, tiny_model_dir: Path) -> None:
    dim = _dim(tiny_model_dir)
    payloads = {"low-a": _input(dim, 10, steps=6, guided=True),
                "low-b": _input(dim, 11, steps=6, guided=False),
                "urgent": _input(dim, 12, steps=2, guided=True)}
    kinds: dict[str, list[str]] = {rid: [] for rid in payloads}
    urgent: list[asyncio.Task[Any]] = []

    async def send_urgent_at_1(call: Any, step: int) -> None:
        if step == 1 and not urgent:
            urgent.append(asyncio.create_task(_denoise(
                group.address, "urgent", payloads["urgent"], priority=-5,
                kinds=kinds["urgent"])))

    low = await asyncio.gather(
        _denoise(group.address, "low-a", payloads["low-a"], send_urgent_at_1,
                 kinds=kinds["low-a"]),
        _denoise(group.address, "low-b", payloads["low-b"], kinds=kinds["low-b"]))
    responses = dict(zip(["low-a", "low-b"], low, strict=True))
    responses["urgent"] = await urgent[0]
    assert any("preempted" in kinds[rid] for rid in ("low-a", "low-b")), kinds
    for rid, response in responses.items():
        assert response.WhichOneof("event") == "result", rid
        want = await asyncio.to_thread(_solo, one_device, Job(rid, payloads[rid]))
        assert (from_proto(response.result.latents) - want).abs().max().item() <= TOLERANCE


async def test_tokens_that_do_not_divide_among_the_ranks_are_refused(
        group: Group, tiny_model_dir: Path) -> None:
    payload = replace(_input(_dim(tiny_model_dir), 7, steps=2, guided=True), height=48,
                      width=48)  # 3 x 3 tokens for 2 Ulysses ranks
    async with grpc.aio.insecure_channel(group.address) as channel:
        call = dit_service_pb2_grpc.DitServiceStub(channel).Denoise()
        await call.write(_start("odd", payload, 0))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parallel_ulysses" in (refused.value.details() or "")


@pytest.mark.parametrize(("options", "match"), [
    ({"parallel_cfg": 3}, "parallel_cfg must be 1 or 2"),
    ({"parallel_ulysses": 0}, "parallel_ulysses must be"),
    ({"parallel_ulysses": 3}, "must divide the model's 2 heads"),
    ({"parallel_cfg": 2, "compile": "blocks"}, "cannot be combined with compile"),
])
async def test_a_group_the_stage_cannot_run_is_refused_at_start(
        tiny_model_dir: Path, options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_stage("dit", tiny_model_dir, options)


async def test_a_dead_rank_is_a_group_fault(group: Group, tiny_model_dir: Path) -> None:
    """Runs last: it ends the module's group."""
    dim = _dim(tiny_model_dir)
    victim = group.pids[0]

    async def kill_at_1(call: Any, step: int) -> None:
        if step == 1:
            os.kill(victim, signal.SIGKILL)

    response = await _denoise(group.address, "doomed", _input(dim, 6, steps=150, guided=True),
                              kill_at_1)
    # accepted, then aborted as a stage that stops aborts (a gateway reports UNAVAILABLE)
    assert response.WhichOneof("event") == "aborted"
    assert response.aborted.reason == common_pb2.ABORT_REASON_SHUTDOWN
    assert response.aborted.step_index < 150
    # the engine stopped: the runtime turns NOT_SERVING and exits 1, to be restarted
    ending = await asyncio.wait_for(until_stopped(group.bundle, group.server), 10)
    assert ending is Ending.ENGINE_DIED
    async with grpc.aio.insecure_channel(group.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    for pid in group.pids:  # the group failed as one: no rank is left running
        await asyncio.wait_for(_gone(pid), 10)


async def _gone(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # our own child: reap it so that it does not linger as a zombie
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        await asyncio.sleep(0.1)
