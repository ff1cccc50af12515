"""Text-to-image: validate parameters, then Tokenizer -> DiT -> VAE for each image."""

from __future__ import annotations

import asyncio
import io
import random
import re
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import Message
from PIL import Image

from stagemesh.gateway.cancel import CancelScope
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.events import Emit, Output, StageEvent
from stagemesh.gateway.recipes import Recipe
from stagemesh.gateway.stage_client import OnEvent, StubFor, call_stage
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)
from stagemesh.shared.tensors import array_from_proto

_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class ImageParams:
    """A validated image request (every field concrete)."""

    prompt: str
    negative_prompt: str | None
    n: int
    width: int
    height: int
    num_inference_steps: int
    true_cfg_scale: float
    seed: int
    execution_mode: int = common_pb2.EXECUTION_MODE_UNSPECIFIED


def parse_size(size: str) -> tuple[int, int]:
    """'WxH' -> (width, height); InvalidRequest naming `size` otherwise."""
    match = _SIZE.match(size)
    if not match:
        raise InvalidRequest("size", f"size must look like '512x512' (WxH), got {size!r}")
    return int(match.group(1)), int(match.group(2))


def validate_image_params(
    recipe: Recipe,
    *,
    prompt: str | None,
    negative_prompt: str | None = None,
    n: int | None = None,
    width: int | None = None,
    height: int | None = None,
    num_inference_steps: int | None = None,
    true_cfg_scale: float | None = None,
    seed: int | None = None,
    execution_mode: int = common_pb2.EXECUTION_MODE_UNSPECIFIED,
) -> ImageParams:
    """Fill defaults from the recipe and check every field before any stage is called."""
    defaults, limits = recipe.image_defaults, recipe.image_limits
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("prompt", "prompt must be a non-empty string")
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidRequest("prompt",
                             f"prompt is longer than {limits.max_prompt_chars} characters")
    if negative_prompt is not None and len(negative_prompt) > limits.max_prompt_chars:
        raise InvalidRequest("negative_prompt",
                             f"negative_prompt is longer than {limits.max_prompt_chars} characters")
    n = 1 if n is None else n
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest("n", f"n must be between 1 and {limits.max_n}, got {n}")
    width = width or defaults.width
    height = height or defaults.height
    for name, value in (("width", width), ("height", height)):
        if value <= 0 or value % limits.size_multiple:
            raise InvalidRequest("size", f"{name} must be a positive multiple of "
                                 f"{limits.size_multiple} for this model, got {value}")
    if width * height > limits.max_pixels:
        raise InvalidRequest("size", f"{width}x{height} exceeds the limit of "
                             f"{limits.max_pixels} pixels")
    steps = defaults.num_inference_steps if num_inference_steps is None else num_inference_steps
    if not 1 <= steps <= limits.max_steps:
        raise InvalidRequest("num_inference_steps",
                             f"num_inference_steps must be between 1 and {limits.max_steps}, "
                             f"got {steps}")
    scale = defaults.true_cfg_scale if true_cfg_scale is None else float(true_cfg_scale)
    if not 0.0 <= scale <= 20.0:
        raise InvalidRequest("true_cfg_scale", f"true_cfg_scale must be in [0, 20], got {scale}")
    if seed is None:
        seed = random.randrange(2**31)
    if not 0 <= seed <= MAX_SEED - n:
        raise InvalidRequest("seed", f"seed must be between 0 and {MAX_SEED - n}, got {seed}")
    if negative_prompt is None:
        negative_prompt = defaults.negative_prompt
    return ImageParams(prompt=prompt, negative_prompt=negative_prompt, n=n, width=width,
                       height=height, num_inference_steps=steps, true_cfg_scale=scale, seed=seed,
                       execution_mode=execution_mode)


@dataclass(frozen=True)
class GeneratedImage:
    png: bytes
    seed: int
    width: int
    height: int


def encode_png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


async def generate_images(
    recipe: Recipe,
    params: ImageParams,
    scope: CancelScope,
    stubs: StubFor,
    emit: Emit | None = None,
) -> list[GeneratedImage]:
    """Tokenizer once, then DiT -> VAE per image (seeds seed, seed+1, ...).

    emit, if given, receives a StageEvent for each queued/progress event and an Output for each
    image as soon as it is decoded.
    """
    on_event: OnEvent | None = None
    if emit is not None:
        async def on_event(stage: str, response: Message) -> None:
            await emit(StageEvent(stage, response))
    tokenizer, dit, vae = stubs("tokenizer"), stubs("dit"), stubs("vae")
    encode_start = tokenizer_service_pb2.EncodePromptStart(
        request_id=scope.request_id, prompt=params.prompt)
    if params.negative_prompt is not None:
        encode_start.negative_prompt = params.negative_prompt
    encoded = await call_stage(scope, "tokenizer", tokenizer.EncodePrompt,
                               tokenizer_service_pb2.EncodePromptRequest, encode_start,
                               on_event=on_event)
    images = []
    for index in range(params.n):
        seed = params.seed + index
        denoised = await call_stage(
            scope, "dit", dit.Denoise, dit_service_pb2.DenoiseRequest,
            dit_service_pb2.DenoiseStart(
                request_id=scope.request_id,
                prompt_embeds=encoded.prompt_embeds,
                prompt_embeds_mask=encoded.prompt_embeds_mask,
                negative_prompt_embeds=encoded.negative_prompt_embeds,
                negative_prompt_embeds_mask=encoded.negative_prompt_embeds_mask,
                height=params.height, width=params.width,
                num_inference_steps=params.num_inference_steps,
                true_cfg_scale=params.true_cfg_scale, seed=seed,
                execution_mode=params.execution_mode),
            on_event=on_event)
        decoded = await call_stage(
            scope, "vae", vae.DecodeLatents, vae_service_pb2.DecodeLatentsRequest,
            vae_service_pb2.DecodeLatentsStart(request_id=scope.request_id,
                                               latents=denoised.latents,
                                               height=params.height, width=params.width),
            on_event=on_event)
        pixels = array_from_proto(decoded.pixels)
        png = await asyncio.to_thread(encode_png, pixels[0])  # off the event loop
        image = GeneratedImage(png=png, seed=seed, width=params.width, height=params.height)
        images.append(image)
        if emit is not None:
            await emit(Output(image))
    return images
