"""The shipped trained model, split over the mesh, gives the stock pipeline's image.

Proof that the mesh splits a real diffusers pipeline faithfully: the same prompt, seed, steps and
guidance through Tokenizer -> DiT -> VAE (real gRPC servers on loopback) give exactly the pixels
of `diffusers.QwenImagePipeline.from_pretrained(<shipped folder>)`, and the float image of the
stage adapters matches the pipeline's to 1e-5.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from PIL import Image

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.images.pipeline import generate_images, prepare_images
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.models.registry import SHIPPED_TINY_SHAPES
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.registry import build_stage
from stagemesh.services.tokenizer.base import PromptInput
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter
from stagemesh.services.vae.qwen_image_adapter import LatentDecoderAdapter, LatentsInput
from stagemesh.shared.engine.adapter import EngineRequest
from stagemesh.shared.stage_runtime import start_stage, stop_stage

pytestmark = pytest.mark.timeout(180)

CASES = [("a red circle on the left", None, 1.0, 3), ("a blue square at the top", "", 4.0, 5)]
STEPS, SIZE = 16, 32


@pytest.fixture(scope="module")
def pipe() -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(SHIPPED_TINY_SHAPES, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe: QwenImagePipeline, prompt: str, negative: str | None, scale: float,
              seed: int, output_type: str) -> Any:
    return pipe(prompt, negative_prompt=negative, true_cfg_scale=scale, height=SIZE, width=SIZE,
                num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                output_type=output_type).images


def run(adapter: Any, payload: Any) -> Any:
    state = adapter.prepare(EngineRequest(request_id="r", payload=payload))
    while not adapter.step([state])[0].finished:
        pass
    result = adapter.finish(state)
    adapter.release(state)
    return result


def test_stage_adapters_match_the_pipeline_to_1e5(pipe: QwenImagePipeline) -> None:
    encoder = PromptEncoderAdapter(SHIPPED_TINY_SHAPES)
    dit = DenoiseAdapter(SHIPPED_TINY_SHAPES)
    vae = LatentDecoderAdapter(SHIPPED_TINY_SHAPES)
    for prompt, negative, scale, seed in CASES:
        embeddings = run(encoder, PromptInput(prompt, negative))
        latents = run(dit, DenoiseInput(embeddings, SIZE, SIZE, STEPS, true_cfg_scale=scale,
                                        seed=seed))
        decoded = run(vae, LatentsInput(latents.latents, latents.height, latents.width))
        expected = reference(pipe, prompt, negative, scale, seed, "np")
        assert np.abs(decoded.images - expected).max() <= 1e-5


async def test_the_mesh_over_grpc_returns_the_pipelines_pixels(
    pipe: QwenImagePipeline, make_image_recipe: Any
) -> None:
    # float32 on every stage, the pipeline's dtype (a stage's CPU default may be bfloat16)
    bundles = {name: build_stage(name, SHIPPED_TINY_SHAPES, {"dtype": "float32"})
               for name in ("tokenizer", "dit", "vae")}
    servers = {name: await start_stage(bundle) for name, bundle in bundles.items()}
    recipe = make_image_recipe({n: f"127.0.0.1:{s.port}" for n, s in servers.items()},
                               SHIPPED_TINY_SHAPES)
    try:
        async with open_gateway({recipe.name: recipe}) as core:
            for prompt, negative, scale, seed in CASES:
                job = await prepare_images(core, ImageRequest(
                    prompt=prompt, negative_prompt=negative, width=SIZE, height=SIZE,
                    num_inference_steps=STEPS, true_cfg_scale=scale, seed=seed))
                (image,) = await generate_images(core, job, RequestContext.create(None, 60))
                pixels = np.asarray(Image.open(io.BytesIO(image.png)).convert("RGB"))
                expected = np.asarray(reference(pipe, prompt, negative, scale, seed, "pil")[0])
                np.testing.assert_array_equal(pixels, expected)
    finally:
        for name, server in servers.items():
            await stop_stage(bundles[name], server, grace=0.5)
