"""A mesh whose recipe says `dtype: bfloat16` serves images and speech end to end on this CPU:
real gRPC stages on loopback, composed by the gateway core.

Images: the shipped tiny-shapes model, against the stock `QwenImagePipeline` in bfloat16. An
unguided image equals the pipeline's pixels exactly; a guided one is within the tolerance that
tests/model/test_image_precision.py states and justifies (16 units of bfloat16 roundoff, 2^-8,
at any pixel, half a unit on average). Speech: csm-tiny, reproducible for a seed. Every stage
publishes where it computes (device and dtype) in its Describe response.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from diffusers import QwenImagePipeline
from PIL import Image

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.images.pipeline import generate_images, prepare_images
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.gateway.mesh.events import Output, StageEvent
from stagemesh.gateway.mesh.stubs import codec_stub, dit_stub, talker_stub, tokenizer_stub, vae_stub
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.gateway.speech import pipeline as speech_serving
from stagemesh.gateway.speech.pipeline import AudioPiece, prepare_speech
from stagemesh.gateway.speech.protocol import SpeechRequest
from stagemesh.models.registry import SHIPPED_TINY_SHAPES
from stagemesh.models.speech import ensure_speech_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import (
    codec_service_pb2,
    common_pb2,
    dit_service_pb2,
    talker_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage

#: The meshes are module-scoped (stages built once, each test leaves them idle), so the tests
#: run on the module's event loop.
pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

BFLOAT16: dict[str, bool | int | float | str] = {"dtype": "bfloat16"}
SIZE, STEPS = 32, 16
UNGUIDED = ("a red circle on the left", None, 1.0, 3)
GUIDED = ("a blue square at the top", "", 4.0, 5)
#: bfloat16's unit roundoff, in 8-bit pixel levels.
U_LEVELS = 2.0**-8 * 255


@dataclass
class Mesh:
    core: GatewayCore
    servers: dict[str, RunningServer]


async def started(names: tuple[str, ...], model_dir: Path
                  ) -> tuple[dict[str, StageBundle], dict[str, RunningServer]]:
    bundles = {name: build_stage(name, model_dir, BFLOAT16) for name in names}
    return bundles, {name: await start_stage(bundle) for name, bundle in bundles.items()}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def image_mesh() -> AsyncIterator[Mesh]:
    bundles, servers = await started(("tokenizer", "dit", "vae"), SHIPPED_TINY_SHAPES)
    recipe = Recipe(name="bf16", task=Task.TEXT_TO_IMAGE, model=str(SHIPPED_TINY_SHAPES),
                    stages={name: StageEndpoint(name, f"127.0.0.1:{server.port}", None, BFLOAT16)
                            for name, server in servers.items()},
                    image_defaults=ImageDefaults(width=SIZE, height=SIZE,
                                                 num_inference_steps=STEPS))
    try:
        async with open_gateway({recipe.name: recipe}) as core:
            yield Mesh(core, servers)
    finally:
        for name, server in servers.items():
            await stop_stage(bundles[name], server, grace=0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def speech_mesh() -> AsyncIterator[Mesh]:
    model_dir = ensure_speech_model()
    bundles, servers = await started(("talker", "codec"), model_dir)
    recipe = Recipe(name="bf16-speech", task=Task.TEXT_TO_SPEECH, model=str(model_dir),
                    stages={name: StageEndpoint(name, f"127.0.0.1:{server.port}", None, BFLOAT16)
                            for name, server in servers.items()})
    try:
        async with open_gateway({recipe.name: recipe}) as core:
            yield Mesh(core, servers)
    finally:
        for name, server in servers.items():
            await stop_stage(bundles[name], server, grace=0.5)


@pytest.fixture(scope="module")
def pipe() -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(SHIPPED_TINY_SHAPES, dtype=torch.bfloat16,
                                             local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


async def mesh_pixels(mesh: Mesh, prompt: str, negative: str | None, scale: float,
                      seed: int) -> np.ndarray:
    job = await prepare_images(mesh.core, ImageRequest(
        prompt=prompt, negative_prompt=negative, width=SIZE, height=SIZE,
        num_inference_steps=STEPS, true_cfg_scale=scale, seed=seed))
    (image,) = await generate_images(mesh.core, job, RequestContext.create(None, 60))
    return np.asarray(Image.open(io.BytesIO(image.png)).convert("RGB")).astype(np.int16)


def stock_pixels(pipe: QwenImagePipeline, prompt: str, negative: str | None, scale: float,
                 seed: int) -> np.ndarray:
    images = pipe(prompt, negative_prompt=negative, true_cfg_scale=scale, height=SIZE,
                  width=SIZE, num_inference_steps=STEPS,
                  generator=torch.Generator().manual_seed(seed), output_type="pil").images
    return np.asarray(images[0]).astype(np.int16)


async def test_an_unguided_image_is_the_bfloat16_pipelines_exactly(
    image_mesh: Mesh, pipe: QwenImagePipeline
) -> None:
    np.testing.assert_array_equal(await mesh_pixels(image_mesh, *UNGUIDED),
                                  stock_pixels(pipe, *UNGUIDED))


async def test_a_guided_image_is_within_the_stated_tolerance(
    image_mesh: Mesh, pipe: QwenImagePipeline
) -> None:
    difference = np.abs(await mesh_pixels(image_mesh, *GUIDED) - stock_pixels(pipe, *GUIDED))
    assert difference.max() <= 16 * U_LEVELS + 1  # + 1: rounding to 8-bit levels
    assert difference.mean() <= U_LEVELS / 2


async def test_the_image_stages_publish_cpu_and_bfloat16(image_mesh: Mesh) -> None:
    channels = image_mesh.core.mesh.channels
    servers = image_mesh.servers
    descriptions = [
        (await tokenizer_stub(channels[address(servers, "tokenizer")]).DescribeTokenizer(
            tokenizer_service_pb2.DescribeTokenizerRequest())).stage,
        (await dit_stub(channels[address(servers, "dit")]).DescribeDit(
            dit_service_pb2.DescribeDitRequest())).stage,
        (await vae_stub(channels[address(servers, "vae")]).DescribeVae(
            vae_service_pb2.DescribeVaeRequest())).stage,
    ]
    assert_placements(descriptions, ["tokenizer", "dit", "vae"])


async def synthesize(mesh: Mesh, seed: int) -> np.ndarray:
    job = await prepare_speech(mesh.core, SpeechRequest(input="Hello there.", voice="vivian",
                                                       seed=seed, max_new_tokens=20))
    pieces: list[AudioPiece] = []

    async def emit(item: StageEvent | Output[AudioPiece]) -> None:
        if isinstance(item, Output):
            pieces.append(item.value)

    await speech_serving.synthesize(mesh.core, job, RequestContext.create(None, 60), emit)
    assert pieces and all(piece.pcm.dtype == np.float32 for piece in pieces)
    return np.concatenate([piece.pcm for piece in pieces])


async def test_speech_is_served_and_reproducible_in_bfloat16(speech_mesh: Mesh) -> None:
    first = await synthesize(speech_mesh, seed=3)
    assert first.size > 0 and np.isfinite(first).all()
    np.testing.assert_array_equal(await synthesize(speech_mesh, seed=3), first)


async def test_the_speech_stages_publish_cpu_and_bfloat16(speech_mesh: Mesh) -> None:
    channels = speech_mesh.core.mesh.channels
    servers = speech_mesh.servers
    descriptions = [
        (await talker_stub(channels[address(servers, "talker")]).DescribeTalker(
            talker_service_pb2.DescribeTalkerRequest())).stage,
        (await codec_stub(channels[address(servers, "codec")]).DescribeCodec(
            codec_service_pb2.DescribeCodecRequest())).stage,
    ]
    assert_placements(descriptions, ["talker", "codec"])


def address(servers: dict[str, RunningServer], name: str) -> str:
    return f"127.0.0.1:{servers[name].port}"


def assert_placements(descriptions: list[common_pb2.StageDescription], names: list[str]) -> None:
    assert [(d.stage, d.device, d.dtype) for d in descriptions] == [
        (name, "cpu", "bfloat16") for name in names]
