"""DecodeLatents for video (AutoencoderKLWan): latents -> uint8 frames, streamed chunk by chunk.

Runs the tail of the stock Wan pipelines (`WanPipeline` / `WanImageToVideoPipeline.__call__`
after the loop): de-normalize with latents_mean / latents_std, `vae.decode`, and
`video_processor.postprocess_video`, to uint8 as VaeImageProcessor.numpy_to_pil rounds.

Steps: `vae._decode` runs its decoder over the latent frames one after another, carrying a
feature cache from frame to frame (the first latent frame gives one video frame, each later one
`scale_factor_temporal`). This adapter runs that loop itself: each engine step decodes
`decode_chunk_frames` latent frames with the request's own cache and streams their video frames
as one partial (`DecodedFrames`), so a cancel stops the decode between chunks (and, via the
engine's StepInterrupt, between the latent frames of a chunk) and nothing more is decoded. Every
step of the clip is elementwise after the decoder, so the frames concatenated equal one-shot
`vae.decode` (tests/model/test_vae_encode_video.py).

A step's frames travel in one gRPC message: the chunk shrinks (never below one latent frame)
to keep them under FRAMES_EVENT_BYTES.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypedDict, assert_never

import numpy as np
import numpy.typing as npt
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    AutoencoderKLWan,
    WanCausalConv3d,
    unpatchify,
)
from diffusers.video_processor import VideoProcessor

from stagemesh.models.families.wan import WanGeometry
from stagemesh.services.vae.encode import check_num_frames
from stagemesh.services.vae.kinds import FeatureCache, cache_slots
from stagemesh.services.vae.limits import VaeLimits, check_size
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, LaunchPacer, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.interrupt import StepInterrupt
from stagemesh.shared.limits import MAX_STAGE_MESSAGE_BYTES

#: Wan's default CPU dtype: float32, as the Wan pipelines keep their VAE (not measured in
#: bfloat16 on a CPU; `dtype: bfloat16` in the recipe opts in).
WAN_CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)

#: Latent frames one step decodes unless the recipe sets `decode_chunk_frames`: 4 latent
#: frames are 13 to 16 video frames, about one second of Wan video (16 fps) per `frames`
#: event, and the longest a cancel waits for a chunk to end.
DEFAULT_DECODE_CHUNK_FRAMES = 4

#: Video frames one request may decode or encode unless the recipe sets `max_frames`: Wan 2.2's
#: longest stock clip (121 frames, 5 s at 24 fps; Wan 2.1 makes 81).
DEFAULT_MAX_FRAMES = 121

#: Largest video height or width in pixels: four frames at this size (one latent frame) fit in
#: one `frames` event.
MAX_VIDEO_SIDE = 2048

#: Most pixel bytes in one `frames` event: the stage message limit, less room for the envelope.
FRAMES_EVENT_BYTES = MAX_STAGE_MESSAGE_BYTES - 64 * 1024

#: Video requests that hold a feature cache at once unless the recipe sets `max_running`; each
#: steps alone (its own cache), so more only interleaves their chunks.
DEFAULT_VIDEO_MAX_RUNNING = 2


class VideoOptions(TypedDict, total=False):
    """Recipe options of a Wan VAE stage (the adapter's keyword arguments)."""

    decode_chunk_frames: int  # latent frames per decode step (one `frames` event)
    max_frames: int  # video frames one request may decode or encode


@dataclass(frozen=True)
class VideoLatentsInput:
    """The DiT's final latents [1, z_dim, latent_frames, h, w], still normalized (any float
    dtype, on any device), and the video they make."""

    latents: torch.Tensor
    height: int
    width: int
    num_frames: int  # (latent_frames - 1) * scale_factor_temporal + 1


@dataclass(frozen=True)
class DecodedFrames:
    """A chunk of video frames, in order."""

    pixels: npt.NDArray[np.uint8]  # [frames, height, width, 3]
    first_frame_index: int


@dataclass(frozen=True)
class DecodedVideo:
    """What is left once every chunk has streamed: how many frames there were."""

    num_frames: int


@dataclass
class VideoState:
    latents: torch.Tensor | None  # post_quant_conv(denormalized) [1, z, F, h, w]; None: released
    per_step: int  # latent frames per step
    cache: FeatureCache
    decoded: int = 0  # latent frames decoded so far

    @property
    def latent_frames(self) -> int:
        return 0 if self.latents is None else int(self.latents.shape[2])


def wan_limits(geometry: WanGeometry, max_frames: int) -> VaeLimits:
    """A Wan VAE's Describe facts: sizes in multiples of its spatial factor, clips of 1 + a
    multiple of its temporal factor (the transformer's patch is the DiT's to ask for)."""
    return VaeLimits(size_multiple=geometry.spatial_factor, max_side=MAX_VIDEO_SIDE,
                     max_frames=max_frames, frame_multiple=geometry.temporal_factor)


class VideoDecoderAdapter:
    """The VAE stage's video decoder: AutoencoderKLWan's decoder, a chunk of latent frames per
    step (see the module docstring)."""

    stage = "vae"

    def __init__(self, vae: AutoencoderKLWan, geometry: WanGeometry, *,
                 placement: Placement = CPU_FLOAT32,
                 decode_chunk_frames: int = DEFAULT_DECODE_CHUNK_FRAMES,
                 max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        """vae: the stage's loaded model (shared with its encoder: this uses only
        `post_quant_conv` and `decoder`, and keeps its caches in the request states).
        Raises ValueError naming the option for a chunk or frame bound below 1."""
        for name, value in (("decode_chunk_frames", decode_chunk_frames),
                            ("max_frames", max_frames)):
            if value < 1:
                raise ValueError(f"stage vae: option {name!r} must be at least 1, got {value}")
        self.vae = vae
        self.placement = placement
        self.decode_chunk_frames = decode_chunk_frames
        self.geometry = geometry
        self.limits = wan_limits(geometry, max_frames)
        self._temporal = geometry.temporal_factor
        self._patch_size: int | None = vae.config.get("patch_size")
        self._slots = cache_slots(vae.decoder, WanCausalConv3d)
        self.video_processor = VideoProcessor(vae_scale_factor=self.limits.size_multiple)
        self._interrupt: StepInterrupt | None = None
        # Keeps the host near an accelerator, so the interrupt check between latent frames
        # sees the decode as it is, not as queued (a no-op on the CPU).
        self._pacer = LaunchPacer(placement.device)
        if self._frame_bytes(MAX_VIDEO_SIDE, MAX_VIDEO_SIDE) * self._temporal > FRAMES_EVENT_BYTES:
            raise ValueError("one latent frame at MAX_VIDEO_SIDE overflows a frames event")

    def bind_interrupt(self, interrupt: StepInterrupt) -> None:
        self._interrupt = interrupt

    def per_step(self, height: int, width: int) -> int:
        """Latent frames per step at this size: decode_chunk_frames, fewer where their video
        frames would overflow one `frames` event (never below one)."""
        fit = FRAMES_EVENT_BYTES // (self._temporal * self._frame_bytes(height, width))
        return max(1, min(self.decode_chunk_frames, fit))

    def budget(self, payload: VideoLatentsInput) -> StepBudget:
        """Steps of the request (its chunks); at least one, even for input check_inputs will
        refuse."""
        latent_frames = payload.latents.shape[2] if payload.latents.ndim == 5 else 1
        per_step = self.per_step(max(payload.height, 1), max(payload.width, 1))
        return StepBudget(total_steps=max(1, -(-latent_frames // per_step)))

    def frames_of(self, latent_frames: int) -> int:
        """Video frames `latent_frames` latent frames decode to."""
        return 0 if latent_frames == 0 else 1 + (latent_frames - 1) * self._temporal

    @staticmethod
    def _frame_bytes(height: int, width: int) -> int:
        return height * width * 3

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: VideoLatentsInput) -> None:
        check_size(self.limits, payload.height, payload.width)
        check_num_frames(self.limits, payload.num_frames, allow_image=False)
        shape = [1, *self.geometry.latent_shape(payload.num_frames, payload.height,
                                                payload.width)]
        latents = payload.latents
        if list(latents.shape) != shape:
            raise InvalidInputError(
                "latents", f"latents for {payload.num_frames} frames of {payload.height}x"
                f"{payload.width} must be {shape}, got {list(latents.shape)}")
        if not latents.is_floating_point() or not bool(torch.isfinite(latents).all()):
            raise InvalidInputError("latents", "latents must be finite floating-point values")

    # -- step machine -------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, request: EngineRequest[VideoLatentsInput]) -> VideoState:
        """De-normalize and run `post_quant_conv` over all frames, as `vae._decode` does first."""
        payload = request.payload
        latents = payload.latents.to(device=self.placement.device, dtype=self.vae.dtype)
        latents = self.vae.post_quant_conv(self.geometry.denormalize(latents))
        return VideoState(latents=latents, per_step=self.per_step(payload.height, payload.width),
                          cache=[None] * self._slots)

    def add_input(self, state: VideoState, payload: NoStream) -> None:
        assert_never(payload)  # the latents come whole with the start

    @torch.inference_mode()
    def step(self, states: Sequence[VideoState]) -> list[StepOutput[DecodedFrames]]:
        """One chunk per state; all or nothing (states change only once every chunk is done)."""
        chunks = [self._decode_chunk(state) for state in states]
        outputs: list[StepOutput[DecodedFrames]] = []
        for state, (cache, frames) in zip(states, chunks, strict=True):
            first = self.frames_of(state.decoded)
            state.cache = cache
            state.decoded = min(state.decoded + state.per_step, state.latent_frames)
            outputs.append(StepOutput(
                step_index=-(-state.decoded // state.per_step),
                finished=state.decoded == state.latent_frames,
                partial=DecodedFrames(pixels=frames, first_frame_index=first)))
        return outputs

    def finish(self, state: VideoState) -> DecodedVideo:
        if state.decoded != state.latent_frames:
            raise RuntimeError("finish() before the last chunk was decoded")
        return DecodedVideo(num_frames=self.frames_of(state.decoded))

    def release(self, state: VideoState) -> None:
        state.latents = None
        state.cache = []

    def batch_key(self, state: VideoState) -> Hashable:
        return id(state)  # each request carries its own feature cache: it steps alone

    # -- one chunk ----------------------------------------------------------------------------

    def _decode_chunk(self, state: VideoState) -> tuple[FeatureCache, npt.NDArray[np.uint8]]:
        """The state's next chunk: its cache after it and its frames (the state is untouched)."""
        if state.latents is None:
            raise RuntimeError("video state used after release")
        cache = list(state.cache)  # the decoder assigns slots, so this is a snapshot
        end = min(state.decoded + state.per_step, state.latent_frames)
        decoded: list[torch.Tensor] = []
        self._pacer.reset()
        for index in range(state.decoded, end):
            if decoded and self._interrupt is not None:
                self._interrupt.check()  # between latent frames: raises if all are cancelled
            frame = state.latents[:, :, index : index + 1]
            decoded.append(self.vae.decoder(frame, feat_cache=cache, feat_idx=[0],
                                            first_chunk=index == 0))
            self._pacer.mark()
        video = torch.cat(decoded, 2)
        if self._patch_size is not None:
            video = unpatchify(video, patch_size=self._patch_size)
        return cache, self._to_pixels(torch.clamp(video, min=-1.0, max=1.0))

    def _to_pixels(self, video: torch.Tensor) -> npt.NDArray[np.uint8]:
        """`postprocess_video(video, "np")` of the one video, to uint8 as numpy_to_pil rounds."""
        frames: npt.NDArray[np.float32] = self.video_processor.postprocess(
            video[0].permute(1, 0, 2, 3), output_type="np")
        pixels: npt.NDArray[np.uint8] = (frames * 255).round().astype(np.uint8)
        return pixels


#: The static proof that the adapter is the VAE stage's StageAdapter for video DecodeLatents.
_: type[StageAdapter[VideoLatentsInput, NoStream, VideoState, DecodedFrames, DecodedVideo]] = (
    VideoDecoderAdapter
)
