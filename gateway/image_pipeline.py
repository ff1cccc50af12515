"""Text-to-image: Tokenizer once, then DiT -> VAE for each image, then PNG."""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from PIL import Image

from stagemesh.gateway.cancel import CancelScope
from stagemesh.gateway.events import Emit, Output, StageEvent
from stagemesh.gateway.image_params import ImageParams
from stagemesh.gateway.stage_client import call_stage
from stagemesh.gateway.stubs import ImageStubs
from stagemesh.shared.proto.v1 import (
    dit_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)
from stagemesh.shared.tensors import array_from_proto


@dataclass(frozen=True)
class GeneratedImage:
    png: bytes
    seed: int
    width: int
    height: int


def encode_png(pixels: npt.NDArray[np.generic]) -> bytes:
    """uint8 RGB pixels [height, width, 3] -> PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(pixels, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


class _Progress:
    """Forwards the queued/progress events of the image stages to `emit`."""

    def __init__(self, emit: Emit[GeneratedImage] | None) -> None:
        self.emit = emit

    async def tokenizer(self, stage: str,
                        response: tokenizer_service_pb2.EncodePromptResponse) -> None:
        if self.emit is not None and response.WhichOneof("event") == "queued":
            await self.emit(StageEvent(stage, response.queued))

    async def dit(self, stage: str, response: dit_service_pb2.DenoiseResponse) -> None:
        kind = response.WhichOneof("event")
        if self.emit is not None and kind in ("queued", "progress"):
            await self.emit(StageEvent(stage, response.queued if kind == "queued"
                                       else response.progress))

    async def vae(self, stage: str, response: vae_service_pb2.DecodeLatentsResponse) -> None:
        if self.emit is not None and response.WhichOneof("event") == "queued":
            await self.emit(StageEvent(stage, response.queued))


async def _encode_prompt(params: ImageParams, scope: CancelScope, stubs: ImageStubs,
                         progress: _Progress) -> tokenizer_service_pb2.EncodePromptResult:
    start = tokenizer_service_pb2.EncodePromptStart(request_id=scope.request_id,
                                                    prompt=params.prompt)
    if params.negative_prompt is not None:
        start.negative_prompt = params.negative_prompt
    encoded = await call_stage(
        scope, "tokenizer", stubs.tokenizer.EncodePrompt,
        tokenizer_service_pb2.EncodePromptRequest(start=start),
        tokenizer_service_pb2.EncodePromptRequest, on_event=progress.tokenizer)
    return encoded.result


async def _draw(params: ImageParams, seed: int, encoded: tokenizer_service_pb2.EncodePromptResult,
                scope: CancelScope, stubs: ImageStubs, progress: _Progress) -> GeneratedImage:
    """DiT -> VAE -> PNG for one seed."""
    denoised = await call_stage(
        scope, "dit", stubs.dit.Denoise, dit_service_pb2.DenoiseRequest(
            start=dit_service_pb2.DenoiseStart(
                request_id=scope.request_id,
                prompt_embeds=encoded.prompt_embeds,
                prompt_embeds_mask=encoded.prompt_embeds_mask,
                negative_prompt_embeds=encoded.negative_prompt_embeds,
                negative_prompt_embeds_mask=encoded.negative_prompt_embeds_mask,
                height=params.height, width=params.width,
                num_inference_steps=params.num_inference_steps,
                true_cfg_scale=params.true_cfg_scale, seed=seed,
                execution_mode=params.execution_mode)),
        dit_service_pb2.DenoiseRequest, on_event=progress.dit)
    decoded = await call_stage(
        scope, "vae", stubs.vae.DecodeLatents, vae_service_pb2.DecodeLatentsRequest(
            start=vae_service_pb2.DecodeLatentsStart(
                request_id=scope.request_id, latents=denoised.result.latents,
                height=params.height, width=params.width)),
        vae_service_pb2.DecodeLatentsRequest, on_event=progress.vae)
    pixels = array_from_proto(decoded.result.pixels)
    png = await asyncio.to_thread(encode_png, pixels[0])  # off the event loop
    return GeneratedImage(png=png, seed=seed, width=params.width, height=params.height)


async def generate_images(params: ImageParams, scope: CancelScope, stubs: ImageStubs,
                          emit: Emit[GeneratedImage] | None = None) -> list[GeneratedImage]:
    """Tokenizer once, then DiT -> VAE per image (seeds seed, seed+1, ...).

    emit, if given, receives a StageEvent for each queued/progress event and an Output for each
    image as soon as it is decoded.
    """
    progress = _Progress(emit)
    encoded = await _encode_prompt(params, scope, stubs, progress)
    images = []
    for index in range(params.n):
        image = await _draw(params, params.seed + index, encoded, scope, stubs, progress)
        images.append(image)
        if emit is not None:
            await emit(Output(image))
    return images

