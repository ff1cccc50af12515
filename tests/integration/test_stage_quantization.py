"""The `quantization` stage option (issue 23): int8 weights in the DiT and the text encoder serve
images end to end, published in Describe; fp8 on a device without it stops the stage at start.
Also the DiT's `compile` option's values (compiled blocks themselves: tests/model/)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.images.pipeline import generate_images, prepare_images
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import (
    dit_service_pb2,
    dit_service_pb2_grpc,
    tokenizer_service_pb2,
    tokenizer_service_pb2_grpc,
)
from stagemesh.shared.stage_runtime import start_stage, stop_stage

from .conftest import IMAGE_STAGES, RunningStage

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


async def _image(stages: dict[str, RunningStage], model_dir: Path,
                 make_image_recipe: Callable[..., Any]) -> np.ndarray:
    recipe = make_image_recipe({n: s.address for n, s in stages.items()}, model_dir)
    core: GatewayCore
    async with open_gateway({"tiny": recipe}) as core:
        job = await prepare_images(core, ImageRequest(prompt="a red circle", width=64,
                                                      height=64, seed=3))
        (image,) = await generate_images(core, job, RequestContext.create(None, 60))
    return np.asarray(Image.open(io.BytesIO(image.png)).convert("RGB"), dtype=np.float64)


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


async def test_compile_off_as_yaml_reads_it_is_accepted(tiny_model_dir: Path) -> None:
    bundle = build_stage("dit", tiny_model_dir, {"compile": False})  # YAML 1.1's bare `off`
    assert bundle.info["compile"] == "off"
