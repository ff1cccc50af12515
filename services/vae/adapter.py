"""VAE stage for Qwen-Image: packed latents -> uint8 RGB pixels, in a single engine step.

Loads the `vae` component of a diffusers Qwen-Image folder and runs the tail of
`QwenImagePipeline.__call__`: unpack, de-normalise with latents_mean / latents_std, decode, and
post-process as the pipeline's image processor does.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor

from stagemesh.models.qwen_image import latent_factor
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, StepOutput

MAX_SIDE = 2048  # pixels


@dataclass(frozen=True)
class LatentsInput:
    """Packed latents [batch, tokens, z_dim * 4] as the DiT stage finishes them."""

    latents: torch.Tensor
    height: int
    width: int


@dataclass(frozen=True)
class DecodedImages:
    """The pipeline's output_type="np" images and the uint8 pixels of its output_type="pil"."""

    images: np.ndarray  # float32 [batch, height, width, 3] in [0, 1]
    pixels: np.ndarray  # uint8 [batch, height, width, 3]


@dataclass
class DecodeState:
    height: int
    width: int
    request: LatentsInput | None  # dropped once decoded
    result: DecodedImages | None = None


class LatentDecoderAdapter:
    """`StageAdapter[DecodeState]` over AutoencoderKLQwenImage."""

    stage = "vae"

    def __init__(self, model_dir: str | Path) -> None:
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            model_dir, subfolder="vae", local_files_only=True
        ).eval()
        self.latent_factor = latent_factor(Path(model_dir))
        self.vae_scale_factor = self.latent_factor // 2
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.latent_factor)
        z_dim = self.vae.config.z_dim
        self._latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
        self._latents_std = torch.tensor(self.vae.config.latents_std).view(1, z_dim, 1, 1, 1)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: Any) -> None:
        if not isinstance(payload, LatentsInput):
            raise TypeError(f"expected LatentsInput, got {type(payload).__name__}")
        height, width, factor = payload.height, payload.width, self.latent_factor
        if not all(0 < side <= MAX_SIDE and side % factor == 0 for side in (height, width)):
            raise InvalidInputError(
                "size",
                f"height and width must be positive multiples of {factor} up to {MAX_SIDE}, "
                f"got {height}x{width}",
            )
        latents = payload.latents
        tokens = (height // factor) * (width // factor)
        channels = self.vae.config.z_dim * 4
        if latents.ndim != 3 or latents.shape[0] < 1 or latents.shape[1:] != (tokens, channels):
            raise InvalidInputError(
                "latents",
                f"latents for {height}x{width} must be [batch, {tokens}, {channels}], "
                f"got {list(latents.shape)}",
            )
        if not latents.is_floating_point() or not bool(torch.isfinite(latents).all()):
            raise InvalidInputError("latents", "latents must be finite floating-point values")

    # -- step machine -------------------------------------------------------------------------

    def prepare(self, request: EngineRequest) -> DecodeState:
        payload: LatentsInput = request.payload
        return DecodeState(height=payload.height, width=payload.width, request=payload)

    def add_input(self, state: DecodeState, payload: Any) -> None:
        raise NotImplementedError("the VAE decode stage takes no streamed input")

    def step(self, states: Sequence[DecodeState]) -> list[StepOutput]:
        outputs = []
        for state in states:
            if state.request is None:
                raise RuntimeError("decode state used after release")
            state.result = self.decode(state.request)
            state.request = None  # the latents are no longer needed
            outputs.append(StepOutput(step_index=1, finished=True))
        return outputs

    def finish(self, state: DecodeState) -> DecodedImages:
        if state.result is None:
            raise RuntimeError("finish() before the decode step ran")
        return state.result

    def release(self, state: DecodeState) -> None:
        state.request = None
        state.result = None

    def batch_key(self, state: DecodeState) -> Hashable:
        return (state.height, state.width)

    # -- phases -------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, request: LatentsInput) -> DecodedImages:
        latents = self.unpack_and_denormalize(request)
        image = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        images = self.image_processor.postprocess(image, output_type="np")
        # VaeImageProcessor.numpy_to_pil's rounding, without building PIL images.
        pixels = (images * 255).round().astype(np.uint8)
        return DecodedImages(images=images, pixels=pixels)

    def unpack_and_denormalize(self, request: LatentsInput) -> torch.Tensor:
        latents = QwenImagePipeline._unpack_latents(
            request.latents, request.height, request.width, self.vae_scale_factor
        )
        latents = latents.to(self.vae.dtype)
        mean = self._latents_mean.to(latents.device, latents.dtype)
        # Divide by the reciprocal, as the pipeline does, so the float results are identical.
        std_inv = 1.0 / self._latents_std.to(latents.device, latents.dtype)
        return latents / std_inv + mean
