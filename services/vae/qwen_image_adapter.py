"""VAE stage for Qwen-Image: packed latents -> uint8 RGB pixels, in a single engine step.

Loads the `vae` component of a diffusers Qwen-Image folder and runs the tail of
`QwenImagePipeline.__call__`: unpack, de-normalise with latents_mean / latents_std, decode, and
post-process as the pipeline's image processor does.

Batching: one step decodes the latents of all its requests (one image size: the batch key) in
as few decoder forwards as `MAX_PIXELS_PER_DECODE` allows. Measured with the bench model at
128x128 on one thread, eight decodes in one forward take about half the CPU time of eight
decodes one by one; each image matches its solo decode within float rounding.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import numpy as np
import numpy.typing as npt
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

from stagemesh.models.families.qwen_image import MAX_IMAGE_SIDE, latent_factor
from stagemesh.services.vae.kinds import latent_stats
from stagemesh.services.vae.limits import VaeLimits, check_size
from stagemesh.services.vae.single_frame import use_single_frame_convs
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)

#: The stage's default dtype on a CPU (`stagemesh.shared.devices.CpuDtype`), from `stagemesh
#: bench dtypes` (1 thread, 20 rounds interleaved) on one 32x32 decode with tiny-shapes' VAE;
#: best float32 / best bfloat16, median per-round bf16 speed-up:
#: Xeon with AMX-BF16 16.8 / 15.6 ms, 1.09x (again 17.0 / 14.9 ms, 1.05x) -> bfloat16;
#: the same CPU held to AVX2 (no bfloat16 instructions) 21.0 / 152.5 ms, 0.18x -> float32.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.bfloat16)

#: Requests the VAE stage decodes in one step (its engine's max_running).
DEFAULT_MAX_RUNNING = 8

#: The most pixels one decoder forward decodes: a step's images are decoded together up to this
#: many (eight 128x128 or four 256x256 images), a larger image alone. It bounds the decoder's
#: activation memory per forward, which grows with the pixels it decodes at once.
MAX_PIXELS_PER_DECODE = 512 * 512


@dataclass(frozen=True)
class LatentsInput:
    """Packed latents [batch, tokens, z_dim * 4] as the DiT stage finishes them (any float
    dtype, on any device: the decoder takes them to its own)."""

    latents: torch.Tensor
    height: int
    width: int


@dataclass(frozen=True)
class DecodedImages:
    """The pipeline's output_type="np" images and the uint8 pixels of its output_type="pil"."""

    images: npt.NDArray[np.float32]  # [batch, height, width, 3] in [0, 1]
    pixels: npt.NDArray[np.uint8]  # [batch, height, width, 3]


@dataclass
class DecodeState:
    height: int
    width: int
    request: LatentsInput | None  # dropped once decoded
    result: DecodedImages | None = None


class LatentDecoderAdapter:
    """The VAE stage's model: AutoencoderKLQwenImage's decoder."""

    stage = "vae"

    def __init__(self, model_dir: str | Path, *, placement: Placement = CPU_FLOAT32) -> None:
        """placement: where the decoder computes, and in what dtype (pixels leave as uint8
        whatever it is)."""
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            model_dir,
            subfolder="vae",
            local_files_only=True,
            dtype=placement.dtype,
            device_map=placement.device_name,  # straight onto the device, not via host memory
        ).eval()
        use_single_frame_convs(self.vae)  # an image is one frame: 2-D convs, a third the cost
        self.placement = placement
        self.latent_factor = latent_factor(model_dir)
        self.vae_scale_factor = self.latent_factor // 2
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.latent_factor)
        self._z_dim: int = self.vae.config.z_dim
        self._latents_mean, self._latents_std = latent_stats(self.vae)
        self.limits = VaeLimits(size_multiple=self.latent_factor, max_side=MAX_IMAGE_SIDE)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: LatentsInput) -> None:
        height, width = payload.height, payload.width
        factor = self.limits.size_multiple
        check_size(self.limits, height, width)
        latents = payload.latents
        tokens = (height // factor) * (width // factor)
        channels = self._z_dim * 4
        if latents.ndim != 3 or latents.shape[0] < 1 or latents.shape[1:] != (tokens, channels):
            raise InvalidInputError(
                "latents",
                f"latents for {height}x{width} must be [batch, {tokens}, {channels}], "
                f"got {list(latents.shape)}",
            )
        if not latents.is_floating_point() or not bool(torch.isfinite(latents).all()):
            raise InvalidInputError("latents", "latents must be finite floating-point values")

    # -- step machine -------------------------------------------------------------------------

    def prepare(self, request: EngineRequest[LatentsInput]) -> DecodeState:
        payload = request.payload
        return DecodeState(height=payload.height, width=payload.width, request=payload)

    def add_input(self, state: DecodeState, payload: NoStream) -> None:
        assert_never(payload)  # the VAE decode stage takes no streamed input

    def step(self, states: Sequence[DecodeState]) -> list[StepOutput[NoStream]]:
        """Decode every state, several images per decoder forward (see the module docstring).
        All or nothing: no state changes until every decode is done."""
        requests = [_pending(state) for state in states]
        results = [
            result
            for group in _decode_groups(requests, MAX_PIXELS_PER_DECODE)
            for result in self.decode_many(group)
        ]
        for state, result in zip(states, results, strict=True):
            state.result = result
            state.request = None  # the latents are no longer needed
        return [StepOutput(step_index=1, finished=True) for _ in states]

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

    def decode(self, request: LatentsInput) -> DecodedImages:
        return self.decode_many([request])[0]

    @torch.inference_mode()
    def decode_many(self, requests: Sequence[LatentsInput]) -> list[DecodedImages]:
        """Each request's images, from one decoder forward over all of them (one image size)."""
        latents = torch.cat([self.unpack_and_denormalize(request) for request in requests])
        image: torch.Tensor = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        images: npt.NDArray[np.float32] = self.image_processor.postprocess(image, output_type="np")
        # VaeImageProcessor.numpy_to_pil's rounding, without building PIL images.
        pixels = (images * 255).round().astype(np.uint8)
        bounds = np.cumsum([0] + [request.latents.shape[0] for request in requests])
        return [
            DecodedImages(images=images[start:end], pixels=pixels[start:end])
            for start, end in itertools.pairwise(bounds)
        ]

    def unpack_and_denormalize(self, request: LatentsInput) -> torch.Tensor:
        unpacked: torch.Tensor = QwenImagePipeline._unpack_latents(
            request.latents, request.height, request.width, self.vae_scale_factor
        )
        latents = unpacked.to(device=self.placement.device, dtype=self.vae.dtype)
        return denormalize(latents, self._latents_mean, self._latents_std)


def denormalize(latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The pipelines' undoing of the latents' normalization before `vae.decode` (Qwen-Image and
    Wan alike), with the config's mean and std moved to the latents' device and dtype."""
    mean = mean.to(latents.device, latents.dtype)
    # Divide by the reciprocal, as the pipelines do, so the float results are identical.
    std_inv = 1.0 / std.to(latents.device, latents.dtype)
    return latents / std_inv + mean


def _pending(state: DecodeState) -> LatentsInput:
    if state.request is None:
        raise RuntimeError("decode state used after release")
    return state.request


def _size(request: LatentsInput) -> tuple[int, int]:
    return request.height, request.width


def _decode_groups(
    requests: Sequence[LatentsInput], max_pixels: int
) -> list[list[LatentsInput]]:
    """Consecutive requests of one size, at most `max_pixels` per group (a larger request
    alone), in order: each group is one decoder forward."""
    groups: list[list[LatentsInput]] = []
    room = 0  # pixels the last group may still take
    for request in requests:
        pixels = request.height * request.width * request.latents.shape[0]
        if groups and _size(groups[-1][0]) == _size(request) and pixels <= room:
            groups[-1].append(request)
            room -= pixels
        else:
            groups.append([request])
            room = max_pixels - pixels
    return groups


#: The static proof that the adapter is the VAE stage's StageAdapter.
_: type[StageAdapter[LatentsInput, NoStream, DecodeState, NoStream, DecodedImages]] = (
    LatentDecoderAdapter
)
