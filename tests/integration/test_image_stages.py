"""Tokenizer, DiT and VAE as real gRPC servers on loopback, composed by the gateway's core."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from PIL import Image
from prometheus_client import REGISTRY

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError, InvalidRequest
from stagemesh.gateway.images.pipeline import ImageJob, generate_images, prepare_images
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.models.families.qwen_image import latent_factor
from stagemesh.serve import free_port
from stagemesh.services.registry import build_stage
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2, dit_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from stagemesh.shared.torch_tensors import to_proto

#: The stages are the module's (see conftest's image_stages): one event loop for every test.
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


def reflected_services(address: str) -> list[str]:
    """Service names a server lists through reflection (a blocking client: run it in a thread)."""
    with grpc.insecure_channel(address) as channel:
        return list(ProtoReflectionDescriptorDatabase(channel).get_services())


def finished(stage: str, status: str) -> float:
    value = REGISTRY.get_sample_value("stagemesh_requests_finished_total",
                                      {"stage": stage, "status": status})
    return value or 0.0


async def generate(core: GatewayCore, **fields: Any) -> list[bytes]:
    job = await prepare_images(core, ImageRequest(**{"prompt": "a red circle", **fields}))
    images = await generate_images(core, job, RequestContext.create(None, 30))
    return [image.png for image in images]


@pytest_asyncio.fixture(loop_scope="module")
async def core(image_stages: dict[str, Any], tiny_model_dir: Path,
               make_image_recipe: Any) -> AsyncIterator[GatewayCore]:
    recipe = make_image_recipe({n: s.address for n, s in image_stages.items()}, tiny_model_dir)
    async with open_gateway({"tiny": recipe}) as core:
        yield core


async def test_prompt_becomes_a_png_of_the_requested_size(core: GatewayCore) -> None:
    first, second = await generate(core, width=64, height=32, seed=7, n=2)
    for png in (first, second):
        image = Image.open(io.BytesIO(png))
        assert image.format == "PNG" and image.size == (64, 32) and image.mode == "RGB"
    assert first != second  # n=2 uses seeds 7 and 8
    assert (await generate(core, width=64, height=32, seed=7))[0] == first


async def test_step_and_request_modes_give_identical_bytes(core: GatewayCore) -> None:
    """Through the whole pipeline, on a DiT that offers REQUEST mode (conftest's options; the
    default mesh does not: tests/e2e/test_serve_cancellation.py)."""
    step, request = [await generate(core, width=64, height=64, num_inference_steps=6, seed=9,
                                    execution_mode=mode)
                     for mode in (common_pb2.EXECUTION_MODE_STEP,
                                  common_pb2.EXECUTION_MODE_REQUEST)]
    assert step == request


async def test_the_gateway_enforces_what_the_stages_publish(
    core: GatewayCore, tiny_model_dir: Path,
) -> None:
    facts = await core.catalog.image_facts(core.recipes["tiny"])
    assert facts.size_multiple == latent_factor(tiny_model_dir)  # the model's own factor
    assert facts.max_steps == 1000  # the DiT's option (its default is 200)
    assert facts.max_prompt_chars == 2000  # the tokenizer's default
    assert facts.execution_modes == (common_pb2.EXECUTION_MODE_STEP,
                                     common_pb2.EXECUTION_MODE_REQUEST)
    dit_requests = finished("dit", "completed") + finished("dit", "failed")
    for fields, field in (({"num_inference_steps": 1001}, "num_inference_steps"),
                          ({"width": 4 * facts.size_multiple + 1}, "size"),
                          ({"prompt": "x" * 2001}, "prompt")):
        with pytest.raises(InvalidRequest) as refused:
            await generate(core, **fields)
        assert refused.value.field_name == field
    assert finished("dit", "completed") + finished("dit", "failed") == dit_requests


async def test_each_stage_reports_health_and_reflects_its_service(
    image_stages: dict[str, Any],
) -> None:
    expected = {"tokenizer": "stagemesh.v1.TokenizerService", "dit": "stagemesh.v1.DitService",
                "vae": "stagemesh.v1.VaeService"}
    for name, stage in image_stages.items():
        async with grpc.aio.insecure_channel(stage.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=expected[name]))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert expected[name] in await asyncio.to_thread(reflected_services, stage.address)


async def open_denoise(stage: Any):
    channel = grpc.aio.insecure_channel(stage.address)
    return channel, dit_service_pb2_grpc.DitServiceStub(channel).Denoise()


async def test_cancel_message_ends_the_stream_with_an_aborted_event(
    image_stages: dict[str, Any], tiny_model_dir: Path
) -> None:
    embeds_dim = _joint_dim(tiny_model_dir)
    channel, call = await open_denoise(image_stages["dit"])
    async with channel:
        await call.write(dit_service_pb2.DenoiseRequest(start=_start(embeds_dim, "c-1", 1000)))
        seen = []
        async for response in call:
            kind = response.WhichOneof("event")
            seen.append(kind)
            if kind == "progress" and response.progress.step_index == 3:
                await call.write(dit_service_pb2.DenoiseRequest(
                    cancel=common_pb2.Cancel(reason="test")))
            if kind == "aborted":
                aborted = response.aborted
                break
        assert seen[0] == "queued" and "result" not in seen
        assert aborted.reason == common_pb2.ABORT_REASON_CANCELLED
        assert 3 <= aborted.step_index <= 5  # stopped at the next step boundary
        assert 0 < aborted.abort_latency_seconds < 5


async def test_a_cancelled_rpc_stops_the_denoise_loop(
    image_stages: dict[str, Any], tiny_model_dir: Path, wait_until: Any,
) -> None:
    aborted_before = finished("dit", "aborted")
    channel, call = await open_denoise(image_stages["dit"])
    async with channel:
        await call.write(dit_service_pb2.DenoiseRequest(
            start=_start(_joint_dim(tiny_model_dir), "c-2", 1000)))
        async for response in call:
            if response.WhichOneof("event") == "progress":
                break
        call.cancel()
    await wait_until(lambda: finished("dit", "aborted") > aborted_before, timeout=5,
                     what="the DiT counting the abort")
    assert finished("dit", "aborted") == aborted_before + 1
    assert image_stages["dit"].bundle.engines[0].num_running == 0


async def test_bad_input_is_invalid_argument_naming_the_field(
    image_stages: dict[str, Any], tiny_model_dir: Path
) -> None:
    channel, call = await open_denoise(image_stages["dit"])
    async with channel:
        await call.write(dit_service_pb2.DenoiseRequest(
            start=_start(_joint_dim(tiny_model_dir), "bad-1", 4, height=65)))
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await call.read()
    error = parse_rpc_error(failure.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.field_name == "size"


async def test_first_message_must_be_start(image_stages: dict[str, Any]) -> None:
    channel, call = await open_denoise(image_stages["dit"])
    async with channel:
        await call.write(dit_service_pb2.DenoiseRequest(cancel=common_pb2.Cancel()))
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await call.read()
    assert parse_rpc_error(failure.value).field_name == "start"


async def test_a_stage_that_is_down_is_unavailable_at_once(
    image_stages: dict[str, Any], tiny_model_dir: Path, make_image_recipe: Any
) -> None:
    addresses = {n: s.address for n, s in image_stages.items()}
    addresses["vae"] = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    async with open_gateway({"tiny": make_image_recipe(addresses, tiny_model_dir)}) as core:
        with pytest.raises(GatewayError) as failure:
            await generate(core)
    assert failure.value.code is grpc.StatusCode.UNAVAILABLE
    assert f"vae stage at {addresses['vae']}" in failure.value.message
    assert failure.value.body()["error"]["code"] == "stage_unavailable"
    assert time.monotonic() - started < 10


async def test_deadline_reaches_the_stage(
    image_stages: dict[str, Any], tiny_model_dir: Path, wait_until: Any,
) -> None:
    async with grpc.aio.insecure_channel(image_stages["dit"].address) as channel:
        call = dit_service_pb2_grpc.DitServiceStub(channel).Denoise(timeout=0.5)
        await call.write(dit_service_pb2.DenoiseRequest(
            start=_start(_joint_dim(tiny_model_dir), "d-1", 1000)))
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            async for _ in call:
                pass
    assert failure.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    engine = image_stages["dit"].bundle.engines[0]
    await wait_until(lambda: engine.num_running == 0, timeout=5,
                     what="the DiT dropping the expired request")


def _joint_dim(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "transformer" / "config.json").read_text())
               ["joint_attention_dim"])


def _start(dim: int, request_id: str, steps: int, **overrides: object):
    import torch

    fields: dict[str, object] = dict(
        request_id=request_id, prompt_embeds=to_proto(torch.randn(1, 5, dim)),
        prompt_embeds_mask=to_proto(torch.ones(1, 5, dtype=torch.int64)), height=64, width=64,
        num_inference_steps=steps, seed=1)
    fields.update(overrides)
    return dit_service_pb2.DenoiseStart(**fields)


async def test_a_stage_that_dies_mid_request_is_unavailable_at_once(
    image_stages: dict[str, Any], tiny_model_dir: Path, make_image_recipe: Any,
    wait_until: Any,
) -> None:
    dit = build_stage("dit", tiny_model_dir)
    dit_server = await start_stage(dit)
    addresses = {n: s.address for n, s in image_stages.items()}
    addresses["dit"] = f"127.0.0.1:{dit_server.port}"
    try:
        async with open_gateway({"tiny": make_image_recipe(addresses, tiny_model_dir)}) as core:
            running = asyncio.create_task(generate(core, num_inference_steps=200, width=512,
                                                   height=512))
            engine = dit.engines[0]
            await wait_until(lambda: engine.num_running == 1 or running.done(), timeout=30,
                             what="the DiT running the request")
            assert engine.num_running == 1
            killed_at = time.monotonic()
            await dit_server.server.stop(0)  # the DiT process goes away mid-denoise
            with pytest.raises(GatewayError) as failure:
                await running
            assert failure.value.code is grpc.StatusCode.UNAVAILABLE
            assert "dit stage" in failure.value.message
            assert time.monotonic() - killed_at < 5
    finally:
        await asyncio.to_thread(dit.engines[0].shutdown, True, 5)


async def test_a_stage_restarted_with_new_options_is_read_again(
    image_stages: dict[str, Any], tiny_model_dir: Path, make_image_recipe: Any,
    wait_until: Any,
) -> None:
    port = free_port()
    addresses = {n: s.address for n, s in image_stages.items()}
    addresses["dit"] = f"127.0.0.1:{port}"
    first = build_stage("dit", tiny_model_dir, {"max_steps": 3})
    first_server = await start_stage(first, port=port)
    async with open_gateway({"tiny": make_image_recipe(addresses, tiny_model_dir)}) as core:
        recipe = core.recipes["tiny"]
        with pytest.raises(InvalidRequest, match="and 3, got 4") as refused:
            await generate(core, num_inference_steps=4)
        assert refused.value.field_name == "num_inference_steps"
        await stop_stage(first, first_server, grace=0.5)
        second = build_stage("dit", tiny_model_dir, {"max_steps": 5})
        second_server = await start_stage(second, port=port)
        try:
            async def reads_the_new_limit() -> bool:
                try:
                    return (await core.catalog.image_facts(recipe)).max_steps == 5
                except GatewayError:  # read while the channel reconnects
                    return False

            await wait_until(reads_the_new_limit, timeout=20,
                             what="the gateway reading the restarted DiT's options")
            assert len(await generate(core, num_inference_steps=4, width=32, height=32)) == 1
        finally:
            await stop_stage(second, second_server, grace=0.5)


def pixels(png: bytes) -> np.ndarray:  # type: ignore[type-arg]
    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


@pytest.fixture
def dit_engine(image_stages: dict[str, Any]) -> Any:
    """The DiT's engine, at its default batching options."""
    return image_stages["dit"].bundle.engines[0]


async def start_trio(core: GatewayCore, request_id: str, timeout: float,
                     engine: Any, wait_until: Any) -> asyncio.Task[Any]:
    """A 3-image request long enough to be stopped, once the DiT runs its three images."""
    job: ImageJob = await prepare_images(core, ImageRequest(
        prompt="a red circle", n=3, num_inference_steps=1000, width=32, height=32))
    running = asyncio.create_task(generate_images(core,
        job, RequestContext.create(request_id, timeout)))
    await wait_until(lambda: engine.num_running == 3 or running.done(), timeout=30,
                     what="the DiT running the three images together")
    assert engine.num_running == 3  # side by side, not one after another
    return running


async def released_all_three(engine: Any, aborted_before: float, wait_until: Any) -> None:
    """Wait until the DiT has let go of the three images, each counted as aborted."""
    await wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0, timeout=5,
                     what="the DiT releasing the three images")
    await wait_until(lambda: finished("dit", "aborted") == aborted_before + 3, timeout=5,
                     what="the DiT counting three aborts")


async def test_n_images_run_side_by_side_in_the_dit_in_index_order(
    core: GatewayCore, dit_engine: Any,
) -> None:
    seen_running: list[int] = []

    async def watch() -> None:
        while True:
            seen_running.append(dit_engine.num_running)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        trio = await generate(core, n=3, seed=11, num_inference_steps=30, width=32, height=32)
    finally:
        watcher.cancel()
    assert max(seen_running) == 3
    for index, png in enumerate(trio):  # image i is seed 11 + i, as if drawn alone
        (alone,) = await generate(core, seed=11 + index, num_inference_steps=30, width=32,
                                  height=32)
        assert np.abs(pixels(png) - pixels(alone)).max() <= 1


async def test_a_cancel_by_id_stops_every_image_of_the_request(
    core: GatewayCore, dit_engine: Any, wait_until: Any,
) -> None:
    aborted_before = finished("dit", "aborted")
    running = await start_trio(core, "trio-1", 60, dit_engine, wait_until)
    outcome = await core.cancel("trio-1")
    assert (outcome.request_id, outcome.stage, outcome.state) == (
        "trio-1", "dit", common_pb2.REQUEST_STATE_ABORTED)
    with pytest.raises(GatewayError) as failure:
        await running
    assert failure.value.code is grpc.StatusCode.CANCELLED
    await released_all_three(dit_engine, aborted_before, wait_until)
    assert core.scopes.get("trio-1") is None


async def test_a_client_gone_or_a_deadline_stops_every_image(
    core: GatewayCore, dit_engine: Any, wait_until: Any,
) -> None:
    aborted_before = finished("dit", "aborted")
    running = await start_trio(core, "trio-2", 60, dit_engine, wait_until)
    running.cancel()  # what a disconnect does to the request's task
    with pytest.raises(asyncio.CancelledError):
        await running
    await released_all_three(dit_engine, aborted_before, wait_until)

    expiring = await start_trio(core, "trio-3", 3, dit_engine, wait_until)
    with pytest.raises(GatewayError) as failure:
        await expiring
    assert failure.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    await released_all_three(dit_engine, aborted_before + 3, wait_until)
