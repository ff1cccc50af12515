"""Video split over the mesh gives the stock Wan pipelines' results.

The real Tokenizer, DiT and VAE stages of `builtin:wan-t2v-tiny` (Wan 2.1-style `WanPipeline`)
and `builtin:wan-i2v-tiny` (Wan 2.2 A14B-style `WanImageToVideoPipeline`: two experts split at
`boundary_ratio`, no image encoder) serve on loopback (real gRPC). A video is driven through them
the way the gateway composes it: Tokenizer (prompt and negative prompt), for image-to-video VAE
EncodeImage of the first frame with its zero padding, DiT over every frame, VAE DecodeLatents
streaming the frames in chunks. For the same prompts, guidance, steps and seed the DiT's latents
equal the stock pipeline's within 1e-5 and every decoded frame is within 1 of the stock frames
(rounded as `numpy_to_pil` rounds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from PIL import Image

from stagemesh.gateway.mesh.calls import CancelScope, call_stage
from stagemesh.models.registry import resolve_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import (
    common_pb2,
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

LATENT_TOLERANCE = 1e-5
#: Small enough for CPU, large enough for two latent frames and the decoder's chunking.
HEIGHT, WIDTH, FRAMES, STEPS = 32, 48, 9, 4


@dataclass(frozen=True)
class Case:
    builtin: str
    prompt: str
    negative_prompt: str
    guidance_scale: float
    seed: int
    with_image: bool


T2V = Case("wan-t2v-tiny", "a red square slides across a blue background", "blurry", 5.0, 5,
           with_image=False)
I2V = Case("wan-i2v-tiny", "a cat walks along a wooden fence", "", 4.0, 9, with_image=True)


def first_frame() -> np.ndarray:
    """An input image of another size than the video's: the stages resize it as the pipeline."""
    return np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)


def stock(case: Case) -> tuple[torch.Tensor, np.ndarray]:
    """The stock pipeline's final latents and its frames rounded to uint8, from one run."""
    folder = resolve_model(f"builtin:{case.builtin}")
    pipeline_class = WanImageToVideoPipeline if case.with_image else WanPipeline
    pipe = pipeline_class.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)  # type: ignore[no-untyped-call]  # diffusers'
    captured: dict[str, torch.Tensor] = {}

    def keep_latents(_: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        captured["latents"] = kwargs["latents"].clone()
        return {}

    extra = {"image": Image.fromarray(first_frame())} if case.with_image else {}
    frames = pipe(prompt=case.prompt, negative_prompt=case.negative_prompt, height=HEIGHT,
                  width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS,
                  guidance_scale=case.guidance_scale,
                  generator=torch.Generator().manual_seed(case.seed),
                  callback_on_step_end=keep_latents, output_type="np", **extra).frames
    return captured["latents"], (frames[0] * 255).round().astype(np.uint8)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[dict[str, dict[str, str]]]:
    """For each case's model: its three real stages (float32) on loopback ports."""
    running: list[tuple[StageBundle, Any]] = []
    addresses: dict[str, dict[str, str]] = {}
    try:
        for case in (T2V, I2V):
            folder = resolve_model(f"builtin:{case.builtin}")
            addresses[case.builtin] = {}
            for name in ("tokenizer", "dit", "vae"):
                bundle = build_stage(name, folder, {"dtype": "float32"})
                server = await start_stage(bundle)
                running.append((bundle, server))
                addresses[case.builtin][name] = f"127.0.0.1:{server.port}"
        yield addresses
    finally:
        for bundle, server in running:
            await stop_stage(bundle, server, grace=0.5)


async def mesh(case: Case, stages: dict[str, str]) -> tuple[torch.Tensor, np.ndarray]:
    """The DiT's final latents and the VAE's frames for `case`, over gRPC, through the
    gateway's own stage client (`call_stage`, under a deadline)."""
    scope = CancelScope(f"video-parity-{case.builtin}", timeout=120)
    request_id = scope.stage_request_id
    channels = {name: open_channel(address) for name, address in stages.items()}
    frames: list[np.ndarray] = []

    async def collect(stage: str, response: vae_service_pb2.DecodeLatentsResponse) -> None:
        if response.WhichOneof("event") == "frames":
            assert response.frames.first_frame_index == sum(len(f) for f in frames)
            frames.append(array_from_proto(response.frames.pixels))

    try:
        tokenizer = tokenizer_service_pb2_grpc.TokenizerServiceStub(channels["tokenizer"])
        dit = dit_service_pb2_grpc.DitServiceStub(channels["dit"])
        vae = vae_service_pb2_grpc.VaeServiceStub(channels["vae"])
        encoded = (await call_stage(
            scope, "tokenizer", tokenizer.EncodePrompt, EncodePromptRequest(
                start=tokenizer_service_pb2.EncodePromptStart(
                    request_id=request_id, prompt=case.prompt,
                    negative_prompt=case.negative_prompt)),
            EncodePromptRequest)).result
        condition: list[common_pb2.Tensor] = []
        if case.with_image:
            image = (await call_stage(
                scope, "vae", vae.EncodeImage, EncodeImageRequest(
                    start=vae_service_pb2.EncodeImageStart(
                        request_id=request_id, image=array_to_proto(first_frame()),
                        height=HEIGHT, width=WIDTH, num_frames=FRAMES)),
                EncodeImageRequest)).result
            condition.append(image.latents)
        denoised = (await call_stage(
            scope, "dit", dit.Denoise, DenoiseRequest(start=dit_service_pb2.DenoiseStart(
                request_id=request_id, prompt_embeds=encoded.prompt_embeds,
                negative_prompt_embeds=encoded.negative_prompt_embeds, height=HEIGHT,
                width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS,
                true_cfg_scale=case.guidance_scale, seed=case.seed,
                condition_latents=condition)),
            DenoiseRequest)).result
        decoded = (await call_stage(
            scope, "vae", vae.DecodeLatents, DecodeLatentsRequest(
                start=vae_service_pb2.DecodeLatentsStart(
                    request_id=request_id, latents=denoised.latents, height=HEIGHT,
                    width=WIDTH, num_frames=denoised.num_frames)),
            DecodeLatentsRequest, on_event=collect)).result
    finally:
        for channel in channels.values():
            await channel.close()
    assert denoised.num_frames == decoded.num_frames == FRAMES
    latents = torch.from_numpy(array_from_proto(denoised.latents).astype(np.float32))
    return latents, np.concatenate(frames)


@on_module_loop
@pytest.mark.parametrize("case", [T2V, I2V], ids=lambda case: case.builtin)
async def test_the_mesh_makes_the_stock_pipelines_video(
    case: Case, served: dict[str, dict[str, str]]
) -> None:
    expected_latents, expected_frames = stock(case)
    latents, frames = await mesh(case, served[case.builtin])
    assert latents.shape == expected_latents.shape == (1, 16, 3, HEIGHT // 8, WIDTH // 8)
    assert (latents - expected_latents).abs().max().item() <= LATENT_TOLERANCE
    assert frames.dtype == np.uint8 and frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    difference = np.abs(frames.astype(np.int16) - expected_frames.astype(np.int16))
    assert difference.max() <= 1
