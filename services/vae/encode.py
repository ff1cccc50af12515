"""EncodeImage: an image -> normalized latents, the conditioning of image edit and image-to-video.

What the stock pipelines do before their denoising loop (see `kinds` for the two ways): resize
and normalize the image, `vae.encode(...)`, the posterior's mode (`sample_mode="argmax"`), then
normalize with the config's latents_mean / latents_std. With `num_frames` > 1 the input is the
clip WanImageToVideoPipeline.prepare_latents builds: the image, then num_frames - 1 zero frames.

Steps: `vae._encode` runs its encoder over temporal chunks one after another (the first frame,
then four frames at a time), carrying a feature cache from chunk to chunk. This adapter runs that
loop itself, one chunk per engine step with the request's own cache, so a cancel lands between
chunks, progress is told per chunk, and requests never share a cache. The zero frames are made
chunk by chunk, never the whole clip at once. The result equals one-shot `vae.encode` to float
rounding (tests/model/test_vae_encode_video.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import assert_never

import numpy as np
import PIL.Image
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, patchify
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from stagemesh.services.vae.kinds import FeatureCache, ImageEncoding, VaeModel, cache_slots
from stagemesh.services.vae.limits import VaeLimits, check_size
from stagemesh.shared.devices import Placement, synchronize
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepBudget,
    StepOutput,
)

#: Frames per chunk after the first, as `vae._encode`'s loop takes them (the first chunk is the
#: first frame alone).
ENCODER_CHUNK_FRAMES = 4

#: The largest image EncodeImage takes, height x width: 16.7 MP (48 MiB as uint8, inside one
#: stage message). The gateway holds clients to the Tokenizer's smaller `max_image_pixels`.
MAX_SOURCE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class EncodeInput:
    """The image as the client sent it, and what to make of it."""

    image: torch.Tensor  # uint8 RGB [height, width, 3], any size up to MAX_SOURCE_PIXELS
    height: int  # resize to this before encoding (pixels)
    width: int
    num_frames: int = 0  # > 1: encode the image + (num_frames - 1) zero frames (Wan I2V)

    @property
    def clip_frames(self) -> int:
        return max(self.num_frames, 1)


def encode_chunks(clip_frames: int) -> int:
    """Encoder chunks (engine steps) for a clip of this many frames, as `vae._encode` counts."""
    return 1 + (max(clip_frames, 1) - 1) // ENCODER_CHUNK_FRAMES


@dataclass
class EncodeState:
    pixels: torch.Tensor | None  # the preprocessed image [1, 3, 1, H, W]; None once released
    chunks: int  # encoder chunks in all
    cache: FeatureCache
    outputs: list[torch.Tensor] = field(default_factory=list)  # one per chunk encoded
    result: torch.Tensor | None = None


@dataclass(frozen=True)
class _Advance:
    """One state's step, computed before any state changes (the step is all or nothing)."""

    cache: FeatureCache
    output: torch.Tensor
    result: torch.Tensor | None  # set on the last chunk


class ImageEncoderAdapter:
    """The VAE stage's encoder: either VAE's `encoder` + `quant_conv`, chunk by chunk."""

    stage = "vae-encode"

    def __init__(self, vae: VaeModel, encoding: ImageEncoding, limits: VaeLimits,
                 placement: Placement) -> None:
        """vae: the stage's loaded model (shared with its decoder: the encoder uses only
        `encoder` and `quant_conv`, and keeps its caches in the request states)."""
        self.vae = vae
        self.encoding = encoding
        self.limits = limits
        self.placement = placement
        self._patch_size: int | None = vae.config.get("patch_size")
        conv = WanCausalConv3d if isinstance(vae.encoder.conv_in, WanCausalConv3d) else (
            QwenImageCausalConv3d)
        self._slots = cache_slots(vae.encoder, conv)

    def budget(self, payload: EncodeInput) -> StepBudget:
        return StepBudget(total_steps=encode_chunks(payload.clip_frames))

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: EncodeInput) -> None:
        image = payload.image
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise InvalidInputError(
                "image", f"image must be uint8 RGB [height, width, 3], got {image.dtype} "
                f"{list(image.shape)}")
        pixels = image.shape[0] * image.shape[1]
        if not 0 < pixels <= MAX_SOURCE_PIXELS:
            raise InvalidInputError(
                "image", f"image must have 1 to {MAX_SOURCE_PIXELS} pixels, got "
                f"{image.shape[0]}x{image.shape[1]}")
        check_size(self.limits, payload.height, payload.width)
        check_num_frames(self.limits, payload.num_frames, allow_image=True)

    # -- step machine -------------------------------------------------------------------------

    def prepare(self, request: EngineRequest[EncodeInput]) -> EncodeState:
        """Resize and normalize the image as the pipeline does (PIL, on the compute thread)."""
        payload = request.payload
        image = PIL.Image.fromarray(np.ascontiguousarray(payload.image.numpy()), mode="RGB")
        pixels = self.encoding.preprocess(image, payload.height, payload.width)
        pixels = pixels.unsqueeze(2).to(device=self.placement.device, dtype=self.vae.dtype)
        return EncodeState(pixels=pixels, chunks=encode_chunks(payload.clip_frames),
                           cache=[None] * self._slots)

    def add_input(self, state: EncodeState, payload: NoStream) -> None:
        assert_never(payload)  # the image comes whole with the start

    @torch.inference_mode()
    def step(self, states: Sequence[EncodeState]) -> list[StepOutput[NoStream]]:
        """One encoder chunk per state; all or nothing (no state changes until all are done)."""
        advances = [self._advance(state) for state in states]
        synchronize(self.placement.device)
        outputs: list[StepOutput[NoStream]] = []
        for state, advance in zip(states, advances, strict=True):
            state.cache = advance.cache
            state.outputs.append(advance.output)
            state.result = advance.result
            done = len(state.outputs)
            outputs.append(StepOutput(step_index=done, finished=done == state.chunks))
        return outputs

    def finish(self, state: EncodeState) -> torch.Tensor:
        if state.result is None:
            raise RuntimeError("finish() before the last encoder chunk ran")
        return state.result

    def release(self, state: EncodeState) -> None:
        state.pixels = None
        state.cache = []
        state.outputs = []
        state.result = None

    def batch_key(self, state: EncodeState) -> Hashable:
        return id(state)  # each request carries its own feature cache: it steps alone

    # -- one chunk ----------------------------------------------------------------------------

    def _advance(self, state: EncodeState) -> _Advance:
        index = len(state.outputs)
        cache = list(state.cache)  # the models assign slots, so this is a snapshot
        chunk = self._chunk(state, index)
        output: torch.Tensor = self.vae.encoder(chunk, feat_cache=cache, feat_idx=[0])
        result = None
        if index + 1 == state.chunks:
            result = self._latents([*state.outputs, output])
        return _Advance(cache=cache, output=output, result=result)

    def _chunk(self, state: EncodeState, index: int) -> torch.Tensor:
        """Chunk `index` of the clip: the image first, then ENCODER_CHUNK_FRAMES zero frames."""
        if state.pixels is None:
            raise RuntimeError("encode state used after release")
        pixels = state.pixels
        if index > 0:
            batch, channels, _, height, width = pixels.shape
            pixels = pixels.new_zeros(batch, channels, ENCODER_CHUNK_FRAMES, height, width)
        return pixels if self._patch_size is None else patchify(pixels, self._patch_size)

    def _latents(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """`vae._encode`'s tail and the pipeline's: quant_conv over all chunks, the posterior's
        mode, normalized."""
        moments: torch.Tensor = self.vae.quant_conv(torch.cat(outputs, 2))
        mode: torch.Tensor = DiagonalGaussianDistribution(moments).mode()
        return self.encoding.normalize(mode)


def check_num_frames(limits: VaeLimits, num_frames: int, *, allow_image: bool) -> None:
    """num_frames within the stage's limits: 1 + a multiple of its frame multiple up to
    max_frames; 0 too where `allow_image` (an image, no video)."""
    if allow_image and num_frames in (0, 1):
        return
    multiple = limits.frame_multiple
    if limits.max_frames == 0:
        raise InvalidInputError(
            "num_frames", f"this VAE takes images only (max_frames 0), got {num_frames} frames")
    if not (0 < num_frames <= limits.max_frames and (num_frames - 1) % multiple == 0):
        raise InvalidInputError(
            "num_frames", f"num_frames must be 1 + a multiple of {multiple}, at most "
            f"{limits.max_frames}, got {num_frames}")


#: The static proof that the adapter is the VAE stage's StageAdapter for EncodeImage.
_: type[StageAdapter[EncodeInput, NoStream, EncodeState, NoStream, torch.Tensor]] = (
    ImageEncoderAdapter
)
