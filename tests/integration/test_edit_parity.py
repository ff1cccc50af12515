"""Image edit split over the mesh gives the stock `QwenImageEditPipeline`'s result.

The real Tokenizer, DiT and VAE stages of `builtin:qwen-image-edit-tiny` serve on loopback (real
gRPC); one edit is driven through them with the gateway's own stage client (`call_stage`, under
a deadline), composed as the gateway composes it (Tokenizer reads the
instruction with the input image, VAE EncodeImage encodes the image at the pipeline's ~1 MP
size, the DiT denoises conditioned on those latents, the VAE decodes). For the same image,
prompts, guidance, steps and seed, the DiT's latents equal the stock pipeline's within 1e-5 and
the decoded pixels are within 1 of the stock pipeline's PIL image.

One guided case per folder: every edit of the seeded folder encodes its input at ~1 MP (stock
semantics), the dominant cost on CPU, and the guided case runs every part the unguided one does.
The trained `builtin:tiny-shapes-edit` conditions at its own area (its condition.json): there the
stock pipeline runs with its resize patched to that area (`stock_condition_area`), the one
change the folder asks of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from PIL import Image

from stagemesh.gateway.mesh.calls import CancelScope, call_stage
from stagemesh.models.families.qwen_image import (
    condition_area,
    edit_image_size,
    stock_condition_area,
)
from stagemesh.models.families.qwen_vl_processor import install_processor_support
from stagemesh.models.registry import resolve_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import (
    dit_service_pb2,
    dit_service_pb2_grpc,
    tokenizer_service_pb2,
    tokenizer_service_pb2_grpc,
    vae_service_pb2,
    vae_service_pb2_grpc,
)
from stagemesh.shared.proto.v1.dit_service_pb2 import DenoiseRequest
from stagemesh.shared.proto.v1.tokenizer_service_pb2 import EncodePromptRequest
from stagemesh.shared.proto.v1.vae_service_pb2 import DecodeLatentsRequest, EncodeImageRequest
from stagemesh.shared.server import open_channel
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage
from stagemesh.shared.tensors import array_from_proto, array_to_proto

pytestmark = pytest.mark.timeout(240)
on_module_loop = pytest.mark.asyncio(loop_scope="module")

PROMPT, NEGATIVE, TRUE_CFG = "make the square blue", " ", 4.0
STEPS, SEED = 3, 11
OUT_WIDTH, OUT_HEIGHT = 96, 64  # explicit, multiples of the model's 32
LATENT_TOLERANCE = 1e-5


def input_image() -> np.ndarray:
    """A 64x48 (4:3) picture: the pipeline resizes it to 1184x896 for both encoders."""
    rng = np.random.default_rng(3)
    return rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)


@pytest.fixture(scope="module", params=["qwen-image-edit-tiny", "tiny-shapes-edit"])
def folder(request: pytest.FixtureRequest) -> Path:
    return resolve_model(f"builtin:{request.param}")


@pytest.fixture(scope="module")
def stock(folder: Path) -> tuple[torch.Tensor, np.ndarray]:
    """The stock pipeline's final (packed) latents and its PIL image as uint8, from one run."""
    install_processor_support()
    pipe = QwenImageEditPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    captured: dict[str, torch.Tensor] = {}

    def keep_latents(_: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        captured["latents"] = kwargs["latents"].clone()
        return {}

    with stock_condition_area(condition_area(folder)):
        images = pipe(image=Image.fromarray(input_image()), prompt=PROMPT,
                      negative_prompt=NEGATIVE, true_cfg_scale=TRUE_CFG, height=OUT_HEIGHT,
                      width=OUT_WIDTH, num_inference_steps=STEPS,
                      generator=torch.Generator().manual_seed(SEED),
                      callback_on_step_end=keep_latents, output_type="pil").images
    return captured["latents"], np.asarray(images[0])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stages(folder: Path) -> AsyncIterator[dict[str, str]]:
    """The three real stages, float32 (the pipeline's dtype), on loopback ports."""
    running: dict[str, tuple[StageBundle, Any]] = {}
    try:
        for name in ("tokenizer", "dit", "vae"):
            bundle = build_stage(name, folder, {"dtype": "float32"})
            running[name] = (bundle, await start_stage(bundle))
        yield {name: f"127.0.0.1:{server.port}" for name, (_, server) in running.items()}
    finally:
        for bundle, server in running.values():
            await stop_stage(bundle, server, grace=0.5)


@on_module_loop
async def test_the_mesh_edits_as_the_stock_pipeline(
    folder: Path, stages: dict[str, str], stock: tuple[torch.Tensor, np.ndarray]
) -> None:
    expected_latents, expected_pixels = stock
    image = array_to_proto(input_image())
    condition_width, condition_height = edit_image_size(64, 48, condition_area(folder))
    scope = CancelScope("edit-parity", timeout=120)
    channels = [open_channel(stages[name]) for name in ("tokenizer", "dit", "vae")]
    try:
        tokenizer = tokenizer_service_pb2_grpc.TokenizerServiceStub(channels[0])
        dit = dit_service_pb2_grpc.DitServiceStub(channels[1])
        vae = vae_service_pb2_grpc.VaeServiceStub(channels[2])
        request_id = scope.stage_request_id
        encoded = (await call_stage(
            scope, "tokenizer", tokenizer.EncodePrompt, EncodePromptRequest(
                start=tokenizer_service_pb2.EncodePromptStart(
                    request_id=request_id, prompt=PROMPT, negative_prompt=NEGATIVE,
                    images=[image])),
            EncodePromptRequest)).result
        condition = (await call_stage(
            scope, "vae", vae.EncodeImage, EncodeImageRequest(
                start=vae_service_pb2.EncodeImageStart(
                    request_id=request_id, image=image, height=condition_height,
                    width=condition_width)),
            EncodeImageRequest)).result
        denoised = (await call_stage(
            scope, "dit", dit.Denoise, DenoiseRequest(start=dit_service_pb2.DenoiseStart(
                request_id=request_id, prompt_embeds=encoded.prompt_embeds,
                prompt_embeds_mask=encoded.prompt_embeds_mask,
                negative_prompt_embeds=encoded.negative_prompt_embeds,
                negative_prompt_embeds_mask=encoded.negative_prompt_embeds_mask,
                height=OUT_HEIGHT, width=OUT_WIDTH, num_inference_steps=STEPS,
                true_cfg_scale=TRUE_CFG, seed=SEED, condition_latents=[condition.latents])),
            DenoiseRequest)).result
        decoded = (await call_stage(
            scope, "vae", vae.DecodeLatents, DecodeLatentsRequest(
                start=vae_service_pb2.DecodeLatentsStart(
                    request_id=request_id, latents=denoised.latents, height=OUT_HEIGHT,
                    width=OUT_WIDTH)),
            DecodeLatentsRequest)).result
    finally:
        for channel in channels:
            await channel.close()

    latents = torch.from_numpy(array_from_proto(denoised.latents).astype(np.float32))
    assert latents.shape == expected_latents.shape
    assert (latents - expected_latents).abs().max().item() <= LATENT_TOLERANCE
    pixels = array_from_proto(decoded.pixels)
    assert pixels.dtype == np.uint8 and pixels.shape == (1, OUT_HEIGHT, OUT_WIDTH, 3)
    difference = np.abs(pixels[0].astype(np.int16) - expected_pixels.astype(np.int16))
    assert difference.max() <= 1
