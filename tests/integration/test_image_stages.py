"""Tokenizer, DiT and VAE as real gRPC servers on loopback, composed by the gateway's Mesh."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from PIL import Image
from prometheus_client import REGISTRY

from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.images import generate_images, validate_image_params
from stagemesh.gateway.mesh import Mesh
from stagemesh.serve import free_port
from stagemesh.services.registry import build_stage
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2, dit_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage
from stagemesh.shared.torch_tensors import to_proto

pytestmark = pytest.mark.timeout(120)


def reflected_services(address: str) -> list[str]:
    """Service names a server lists through reflection (a blocking client: run it in a thread)."""
    with grpc.insecure_channel(address) as channel:
        return list(ProtoReflectionDescriptorDatabase(channel).get_services())


def finished(stage: str, status: str) -> float:
    value = REGISTRY.get_sample_value("stagemesh_requests_finished_total",
                                      {"stage": stage, "status": status})
    return value or 0.0


async def generate(mesh: Mesh, **fields: object) -> list[bytes]:
    recipe = next(iter(mesh.recipes.values()))
    params = validate_image_params(recipe, **{"prompt": "a red circle", **fields})
    async with mesh.request_scope(recipe, None, 30) as scope:
        images = await generate_images(recipe, params, scope, mesh.stubs(recipe))
    return [image.png for image in images]


@pytest.fixture
async def mesh(image_stages: dict[str, Any], tiny_model_dir: Path, make_image_recipe: Any):
    mesh = Mesh({"tiny": make_image_recipe({n: s.address for n, s in image_stages.items()},
                                      tiny_model_dir)})
    await mesh.start()
    yield mesh
    await mesh.close()


async def test_prompt_becomes_a_png_of_the_requested_size(mesh: Mesh) -> None:
    first, second = await generate(mesh, width=64, height=32, seed=7, n=2)
    for png in (first, second):
        image = Image.open(io.BytesIO(png))
        assert image.format == "PNG" and image.size == (64, 32) and image.mode == "RGB"
    assert first != second  # n=2 uses seeds 7 and 8
    assert (await generate(mesh, width=64, height=32, seed=7))[0] == first


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
        assert 0 <= aborted.abort_latency_seconds < 5


async def test_a_cancelled_rpc_stops_the_denoise_loop(
    image_stages: dict[str, Any], tiny_model_dir: Path
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
    for _ in range(100):
        if finished("dit", "aborted") > aborted_before:
            break
        await asyncio.sleep(0.05)
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
    mesh = Mesh({"tiny": make_image_recipe(addresses, tiny_model_dir)})
    await mesh.start()
    started = time.monotonic()
    with pytest.raises(GatewayError) as failure:
        await generate(mesh)
    await mesh.close()
    assert failure.value.code is grpc.StatusCode.UNAVAILABLE
    assert "vae stage" in failure.value.message
    assert time.monotonic() - started < 10


async def test_deadline_reaches_the_stage(
    image_stages: dict[str, Any], tiny_model_dir: Path
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
    for _ in range(100):
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.num_running == 0


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
    image_stages: dict[str, Any], tiny_model_dir: Path, make_image_recipe: Any
) -> None:
    dit = build_stage("dit", tiny_model_dir)
    dit_server = await start_stage(dit)
    addresses = {n: s.address for n, s in image_stages.items()}
    addresses["dit"] = f"127.0.0.1:{dit_server.port}"
    mesh = Mesh({"tiny": make_image_recipe(addresses, tiny_model_dir)})
    await mesh.start()
    try:
        running = asyncio.create_task(generate(mesh, num_inference_steps=200, width=512,
                                               height=512))
        engine = dit.engines[0]
        for _ in range(500):
            if engine.num_running or running.done():
                break
            await asyncio.sleep(0.01)
        assert engine.num_running == 1
        killed_at = time.monotonic()
        await dit_server.server.stop(0)  # the DiT process goes away mid-denoise
        with pytest.raises(GatewayError) as failure:
            await running
        assert failure.value.code is grpc.StatusCode.UNAVAILABLE
        assert "dit stage" in failure.value.message
        assert time.monotonic() - killed_at < 5
    finally:
        await mesh.close()
        await asyncio.to_thread(dit.engines[0].shutdown, True, 5)
