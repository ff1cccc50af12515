"""Runtime LoRA updates on a real tiny DiT stage (services/dit/lora_updates.py) over gRPC.

While a request runs under `ink` (one slot, so every other adapter waits for it): `wax` is
loaded, a request naming it waits for the slot, a third naming `ink` queues; `ink` is unloaded.
The running request finishes with the latents it has alone, the queued one is INVALID_ARGUMENT
naming `lora`, a new one naming `ink` is refused at once, and `wax` then evicts the unloaded
adapter's slot and finishes equal to its solo run. A path out of `lora_dir` (absolute, `..`,
a symlink) is refused naming `lora_path`, and a stage without the option refuses every update.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

from stagemesh.services.dit.servicer import DitServicer
from stagemesh.services.registry import build_stage
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2, dit_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from stagemesh.shared.tensors import array_from_proto
from stagemesh.shared.torch_tensors import to_proto
from tests.lora_files import write_adapter

if TYPE_CHECKING:  # the async stub class exists only in the generated .pyi file
    from stagemesh.shared.proto.v1.dit_service_pb2_grpc import DitServiceAsyncStub as Stub

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]

TOLERANCE = 1e-5
#: The first request's steps: enough that the loads and unloads land while it still runs; the
#: others' (they need only finish).
LONG, SHORT = 80, 8


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ink` in the directory (found at start); `incoming/wax` only by path (a folder without
    weights of its own is no adapter); `escape` links out of it."""
    root = tmp_path_factory.mktemp("loras")
    transformer = QwenImageTransformer2DModel.from_pretrained(
        tiny_model_dir, subfolder="transformer", local_files_only=True
    )
    write_adapter(transformer, root, "ink", 4, 1, alpha=8)
    (root / "incoming").mkdir()
    write_adapter(transformer, root / "incoming", "wax", 8, 2)
    outside = tmp_path_factory.mktemp("outside")
    write_adapter(transformer, outside, "evil", 2, 3, bare=True)
    (root / "escape").symlink_to(outside)
    return root


@pytest.fixture(scope="module")
def dim(tiny_model_dir: Path) -> int:
    config = QwenImageTransformer2DModel.load_config(tiny_model_dir / "transformer")
    return int(config["joint_attention_dim"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(tiny_model_dir: Path, lora_dir: Path) -> AsyncIterator[Stub]:
    options = {"lora_dir": str(lora_dir), "runtime_lora_updates": True, "max_loras": 1,
               "max_lora_rank": 8, "max_loras_per_request": 1, "max_running": 2,
               "max_batch": 2}  # fmt: skip
    bundle = build_stage("dit", tiny_model_dir, options)
    server = await start_stage(bundle)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield dit_service_pb2_grpc.DitServiceStub(channel)
    finally:
        await stop_stage(bundle, server, grace=0.5)


def _start(dim: int, rid: str, seed: int, lora: str | None,
           steps: int = SHORT) -> dit_service_pb2.DenoiseRequest:
    uses = [common_pb2.LoraAdapter(name=lora, scale=0.8)] if lora else []
    generator = torch.Generator().manual_seed(seed)
    return dit_service_pb2.DenoiseRequest(start=dit_service_pb2.DenoiseStart(
        request_id=rid, prompt_embeds=to_proto(torch.randn(1, 5, dim, generator=generator)),
        height=32, width=32, num_inference_steps=steps, seed=seed, lora=uses))


class Run:
    """One Denoise stream read in a task: its events, and its latents or its failure."""

    def __init__(self, stub: Stub, request: dit_service_pb2.DenoiseRequest) -> None:
        self.events: list[str] = []
        self.latents: np.ndarray[Any, Any] | None = None
        self.task = asyncio.create_task(self._read(stub, request))

    async def _read(self, stub: Stub, request: dit_service_pb2.DenoiseRequest) -> None:
        async for response in stub.Denoise(iter([request])):
            self.events.append(str(response.WhichOneof("event")))
            if response.HasField("result"):
                self.latents = array_from_proto(response.result.latents)

    async def failure(self) -> tuple[grpc.StatusCode, str | None]:
        return await _refused(self.task)

    async def until(self, event: str) -> None:
        while event not in self.events:
            assert not self.task.done(), self.events
            await asyncio.sleep(0.005)


async def _refused(call: Any) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    error = parse_rpc_error(caught.value)
    return error.code, error.field_name


async def _names(stub: Stub) -> list[str]:
    return list((await stub.DescribeDit(dit_service_pb2.DescribeDitRequest())).lora_names)


async def _solo(stub: Stub, request: dit_service_pb2.DenoiseRequest) -> np.ndarray[Any, Any]:
    run = Run(stub, request)
    await run.task
    assert run.latents is not None
    return run.latents


async def test_load_unload_and_eviction_under_load_leave_running_requests_alone(
    stub: Stub, dim: int
) -> None:
    assert await _names(stub) == ["ink"]
    running = Run(stub, _start(dim, "running", 1, "ink", LONG))
    await running.until("progress")
    loaded = await stub.LoadLoraAdapter(
        dit_service_pb2.LoadLoraAdapterRequest(lora_name="wax", lora_path="incoming/wax"))
    assert loaded.added and list(loaded.lora_names) == ["ink", "wax"]
    waiting = Run(stub, _start(dim, "waiting", 2, "wax"))  # the one slot is ink's: it waits
    await waiting.until("queued")
    queued = Run(stub, _start(dim, "queued", 3, "ink"))  # max_running 2: it queues
    await queued.until("queued")
    unloaded = await stub.UnloadLoraAdapter(
        dit_service_pb2.UnloadLoraAdapterRequest(lora_name="ink"))
    assert list(unloaded.lora_names) == ["wax"] == await _names(stub)
    assert "result" not in running.events, "the unload came too late to be deferred"
    fresh = Run(stub, _start(dim, "fresh", 4, "ink"))
    assert await fresh.failure() == (grpc.StatusCode.INVALID_ARGUMENT, "lora")
    await running.task
    assert await queued.failure() == (grpc.StatusCode.INVALID_ARGUMENT, "lora")
    await waiting.task
    # the same file under its old name again: the running request was never altered
    again = await stub.LoadLoraAdapter(
        dit_service_pb2.LoadLoraAdapterRequest(lora_name="ink", lora_path="ink"))
    assert again.added
    for run, seed, name, steps in ((running, 1, "ink", LONG), (waiting, 2, "wax", SHORT)):
        assert run.latents is not None
        solo = await _solo(stub, _start(dim, f"solo-{seed}", seed, name, steps))
        assert np.abs(run.latents - solo).max() <= TOLERANCE, name
    plain = await _solo(stub, _start(dim, "plain", 2, None))
    assert waiting.latents is not None and np.abs(plain - waiting.latents).max() > 1e-3


async def test_updates_are_checked_and_bounded_to_the_directory(
    stub: Stub, lora_dir: Path
) -> None:
    def load(name: str, path: str) -> Any:
        return stub.LoadLoraAdapter(
            dit_service_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path))

    outside = (lora_dir / "escape").resolve()
    for path in (str(outside / "evil.safetensors"), f"../{outside.name}/evil.safetensors",
                 "escape/evil.safetensors", "escape", "nothing-here", ""):
        assert await _refused(load("evil", path)) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                      "lora_path"), path
    for name in ("", "../x", "a b", "x" * 129):
        assert await _refused(load(name, "ink")) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                     "lora_name"), name
    await load("wax", "incoming/wax")
    assert (await load("wax", "incoming/wax")).added is False  # the same file: no change
    assert await _refused(load("wax", "ink")) == (grpc.StatusCode.ALREADY_EXISTS, "lora_name")
    assert await _refused(stub.UnloadLoraAdapter(
        dit_service_pb2.UnloadLoraAdapterRequest(lora_name="nope"))) == (
        grpc.StatusCode.NOT_FOUND, "lora_name")
    assert "evil" not in await _names(stub)


class _Context:
    """A servicer context that records the status an RPC ends with."""

    async def abort_with_status(self, status: Any) -> None:
        raise grpc.aio.AbortError(status.code)


async def test_a_stage_without_the_option_refuses_updates() -> None:
    servicer: DitServicer[Any, Any] = DitServicer(
        engine=None, wire=None, description=dit_service_pb2.DescribeDitResponse())  # type: ignore[arg-type]
    for call in (servicer.LoadLoraAdapter(dit_service_pb2.LoadLoraAdapterRequest(
                     lora_name="ink", lora_path="ink"), _Context()),  # type: ignore[arg-type]
                 servicer.UnloadLoraAdapter(dit_service_pb2.UnloadLoraAdapterRequest(
                     lora_name="ink"), _Context())):  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AbortError) as caught:
            await call
        assert caught.value.args[0] is grpc.StatusCode.FAILED_PRECONDITION
