"""The `quantization` stage option (issue 23): int8 weights in the DiT and the text encoder serve
images end to end, published in Describe; fp8 on a device without it stops the stage at start.
Also the DiT's `compile` option's values, and a recipe with both `compile: blocks` and
`quantization: int8` served over REST and gRPC, its stage list showing both (compiled blocks
against eager: tests/model/test_dit_compile.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image
from prometheus_client import REGISTRY

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.images.pipeline import generate_images, prepare_images
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import (
    dit_service_pb2,
    dit_service_pb2_grpc,
    gateway_service_pb2,
    gateway_service_pb2_grpc,
    tokenizer_service_pb2,
    tokenizer_service_pb2_grpc,
)
from stagemesh.shared.stage_runtime import start_stage, stop_stage

from .conftest import IMAGE_STAGES, RunningStage, image_recipe
from .fake_stages import gateway_stub

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

#: An int8 image may differ from the float32 one by at most this mean absolute error (of 255):
#: weight-only int8 moves the tiny DiT's output by ~3e-4 relative per step.
MAX_MEAN_ABS_ERROR = 4.0


@pytest.mark.parametrize("stage", ["dit", "tokenizer"])
@pytest.mark.parametrize("value", ["fp8", "int4", True])
async def test_unsupported_quantization_stops_the_stage_at_start(
    tiny_model_dir: Path, stage: str, value: object
) -> None:
    with pytest.raises(ValueError, match="quantization"):
        build_stage(stage, tiny_model_dir, {"quantization": value})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def int8_stages(tiny_model_dir: Path) -> AsyncIterator[dict[str, RunningStage]]:
    stages = {}
    for name in IMAGE_STAGES:
        options = {"quantization": "int8"} if name in ("dit", "tokenizer") else {}
        bundle = build_stage(name, tiny_model_dir, options)
        stages[name] = RunningStage(bundle, await start_stage(bundle))
    yield stages
    for stage in stages.values():
        await stop_stage(stage.bundle, stage.server, grace=0.5)


def _rgb(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


async def _image(stages: dict[str, RunningStage], model_dir: Path,
                 make_image_recipe: Callable[..., Any]) -> np.ndarray:
    recipe = make_image_recipe({n: s.address for n, s in stages.items()}, model_dir)
    core: GatewayCore
    async with open_gateway({"tiny": recipe}) as core:
        job = await prepare_images(core, ImageRequest(prompt="a red circle", width=64,
                                                      height=64, seed=3))
        (image,) = await generate_images(core, job, RequestContext.create(None, 60))
    return _rgb(image.png)


async def test_int8_stages_publish_it_and_serve_images_close_to_float32(
    int8_stages: dict[str, RunningStage], image_stages: dict[str, RunningStage],
    tiny_model_dir: Path, make_image_recipe: Callable[..., Any],
) -> None:
    async with grpc.aio.insecure_channel(int8_stages["dit"].address) as channel:
        dit = await dit_service_pb2_grpc.DitServiceStub(channel).DescribeDit(
            dit_service_pb2.DescribeDitRequest())
    async with grpc.aio.insecure_channel(int8_stages["tokenizer"].address) as channel:
        tokenizer = await tokenizer_service_pb2_grpc.TokenizerServiceStub(
            channel).DescribeTokenizer(tokenizer_service_pb2.DescribeTokenizerRequest())
    assert (dit.quantization, tokenizer.quantization) == ("int8", "int8")
    assert int8_stages["dit"].bundle.info["quantization"] == "int8"

    quantized = await _image(int8_stages, tiny_model_dir, make_image_recipe)
    reference = await _image(image_stages, tiny_model_dir, make_image_recipe)
    assert quantized.shape == reference.shape == (64, 64, 3)
    error = float(np.abs(quantized - reference).mean())
    assert 0 < error <= MAX_MEAN_ABS_ERROR  # quantized (not bit-identical), and close


async def test_float_stages_publish_none(image_stages: dict[str, RunningStage]) -> None:
    async with grpc.aio.insecure_channel(image_stages["dit"].address) as channel:
        dit = await dit_service_pb2_grpc.DitServiceStub(channel).DescribeDit(
            dit_service_pb2.DescribeDitRequest())
    assert (dit.quantization, dit.compile) == ("none", "off")


@pytest.mark.parametrize("value", ["fast", True, 1])
async def test_an_unknown_compile_value_stops_the_stage_at_start(
    tiny_model_dir: Path, value: object
) -> None:
    with pytest.raises(ValueError, match="compile"):
        build_stage("dit", tiny_model_dir, {"compile": value})


async def test_compile_with_lora_dir_stops_the_stage_naming_both(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="compile=blocks cannot be combined with lora_dir"):
        build_stage("dit", tiny_model_dir, {"compile": "blocks", "lora_dir": str(tmp_path)})


async def test_compile_off_as_yaml_reads_it_is_accepted(tiny_model_dir: Path) -> None:
    bundle = build_stage("dit", tiny_model_dir, {"compile": False})  # YAML 1.1's bare `off`
    assert bundle.info["compile"] == "off"


# -- a recipe with compile: blocks and quantization: int8, over REST and gRPC ----------------

#: Building the compiled DiT compiles its blocks and warms them up: minutes on a busy 2-core
#: machine the first time, seconds once inductor's on-disk cache holds its graphs.
COMPILE_TIMEOUT_S = 1200


@dataclass
class Accelerated:
    """The gateway's two transports over a recipe whose DiT runs int8 blocks compiled."""

    http: httpx.AsyncClient
    grpc: gateway_service_pb2_grpc.GatewayServiceAsyncStub


def recompiles() -> float:
    return REGISTRY.get_sample_value("stagemesh_dit_recompiles_total") or 0.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def accelerated(int8_stages: dict[str, RunningStage],
                      tiny_model_dir: Path) -> AsyncIterator[Accelerated]:
    """A DiT with `quantization: int8` and `compile: blocks` between the int8 tokenizer and
    the VAE of `int8_stages`; the REST app (in process) and the public gRPC API over it."""
    # max_side 64: the warm-up compiles only the size these tests ask for (every size and
    # batch shape is tests/model/test_dit_compile.py's).
    bundle = build_stage("dit", tiny_model_dir, {"quantization": "int8", "compile": "blocks",
                                                 "max_side": 64})
    dit = RunningStage(bundle, await start_stage(bundle))
    addresses = {"tokenizer": int8_stages["tokenizer"].address, "dit": dit.address,
                 "vae": int8_stages["vae"].address}
    try:
        async with open_gateway({"tiny": image_recipe(addresses, tiny_model_dir)}) as core:
            transport = httpx.ASGITransport(app=build_rest_app(core))
            async with (httpx.AsyncClient(transport=transport, base_url="http://gw",
                                          timeout=120) as http, gateway_stub(core) as stub):
                yield Accelerated(http, stub)
    finally:
        await stop_stage(dit.bundle, dit.server, grace=0.5)


@pytest.mark.slow
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
async def test_the_stage_list_shows_the_quantization_and_compile_in_force(
    accelerated: Accelerated,
) -> None:
    expected = {"tokenizer": ("int8", ""), "dit": ("int8", "blocks"), "vae": ("", "")}
    response = await accelerated.http.get("/v1/stages")
    assert response.status_code == 200
    listed = {row["name"]: (row["quantization"], row["compile"])
              for row in response.json()["stages"]}
    assert listed == expected
    reply = await accelerated.grpc.ListStages(gateway_service_pb2.ListStagesRequest())
    assert {row.name: (row.quantization, row.compile) for row in reply.stages} == expected


@pytest.mark.slow
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
async def test_int8_compiled_blocks_serve_images_over_rest_and_grpc_without_a_compile(
    accelerated: Accelerated, image_stages: dict[str, RunningStage], tiny_model_dir: Path,
    make_image_recipe: Callable[..., Any],
) -> None:
    """The same request over both transports gives the same image, close to float32's; no
    request compiles a graph (the stage's warm-up covered it)."""
    before = recompiles()
    response = await accelerated.http.post("/v1/images/generations", json={
        "prompt": "a red circle", "size": "64x64", "seed": 3})
    assert response.status_code == 200, response.text
    over_rest = _rgb(base64.b64decode(response.json()["data"][0]["b64_json"]))
    replies = [reply async for reply in accelerated.grpc.GenerateImage(
        gateway_service_pb2.GenerateImageRequest(prompt="a red circle", width=64, height=64,
                                                 seed=3))]
    (image,) = [image for reply in replies if reply.HasField("result")
                for image in reply.result.images]
    np.testing.assert_array_equal(_rgb(image.png), over_rest)
    reference = await _image(image_stages, tiny_model_dir, make_image_recipe)
    assert over_rest.shape == reference.shape == (64, 64, 3)
    assert float(np.abs(over_rest - reference).mean()) <= MAX_MEAN_ABS_ERROR
    assert recompiles() == before
