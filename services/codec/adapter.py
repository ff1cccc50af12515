"""Codec stage: Mimi codec frames <-> audio (`transformers.MimiModel`).

`CodecDecoderAdapter` decodes frames incrementally while the talker is still producing them:
frames arrive through `add_input`, and a step decodes one chunk whenever the async-chunk rule
(`stagemesh.services.codec.chunking`) says so. Each chunk is decoded with up to
`left_context_frames` earlier frames in front and those frames' samples trimmed, so the
concatenated chunks equal a one-shot decode of all frames (Mimi's decoder is causal; the
context covers its receptive field).

`CodecEncoderAdapter` turns a reference clip into codec frames (voice cloning), in one step.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from transformers import MimiModel

from stagemesh.models.speech import codec_dir
from stagemesh.services.codec.chunking import ChunkRule, ChunkTracker, Emission
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StepOutput,
)

#: Longest utterance one decode request may carry, and longest reference clip to encode.
MAX_DECODE_SECONDS = 600
MAX_REF_AUDIO_SECONDS = 30
MIN_SAMPLE_RATE = 8_000
MAX_SAMPLE_RATE = 192_000


def _load_codec(model_dir: str | Path) -> MimiModel:
    return MimiModel.from_pretrained(codec_dir(model_dir), local_files_only=True).eval()


def _samples_per_frame(codec: MimiModel) -> int:
    config = codec.config
    return round(config.sampling_rate / config.frame_rate)


# -- decode -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeInput:
    """Starts a decode. The chunk sizes are in frames; `frames` may already carry some."""

    chunk_frames: int = 25
    initial_chunk_frames: int = 5
    left_context_frames: int = 25
    frames: torch.Tensor | None = None  # [n, num_codebooks] integer codes
    final: bool = False


@dataclass(frozen=True)
class FramesInput:
    """More frames for a running decode; `final` says no more will come."""

    frames: torch.Tensor  # [n, num_codebooks] integer codes; n may be 0 with final=True
    final: bool = False


@dataclass(frozen=True)
class DecodeResult:
    """Summary of a finished decode; the audio itself left as the steps' partials."""

    sample_rate: int
    num_frames: int
    num_samples: int


@dataclass
class DecodeState:
    request_id: str
    tracker: ChunkTracker
    codes: torch.Tensor  # [kept, Q]: the frames from `base` on
    base: int = 0  # request frame index of codes[0]; earlier frames are no longer needed
    received: int = 0
    final: bool = False
    chunks: int = 0
    samples: int = 0


class CodecDecoderAdapter:
    """`StageAdapter[DecodeState]`: streamed codec frames -> float32 PCM chunks."""

    stage = "codec"

    def __init__(self, model_dir: str | Path) -> None:
        self._codec = _load_codec(model_dir)
        config = self._codec.config
        self.sample_rate: int = config.sampling_rate
        self.samples_per_frame = _samples_per_frame(self._codec)
        self.num_codebooks: int = config.num_quantizers
        self._codebook_size: int = config.codebook_size
        self._max_frames = math.ceil(MAX_DECODE_SECONDS * config.frame_rate)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: Any) -> None:
        if not isinstance(payload, DecodeInput):
            raise TypeError(f"expected DecodeInput, got {type(payload).__name__}")
        for name in ("chunk_frames", "initial_chunk_frames"):
            if getattr(payload, name) < 1:
                raise InvalidInputError(name, f"{name} must be >= 1, got {getattr(payload, name)}")
        if payload.left_context_frames < 0:
            raise InvalidInputError(
                "left_context_frames",
                f"left_context_frames must be >= 0, got {payload.left_context_frames}",
            )
        if payload.frames is not None:
            self._check_frames(payload.frames, already=0)

    def _check_frames(self, frames: torch.Tensor, already: int) -> None:
        if (
            not isinstance(frames, torch.Tensor)
            or frames.ndim != 2
            or frames.shape[1] != self.num_codebooks
            or frames.dtype.is_floating_point
            or frames.dtype == torch.bool
        ):
            shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames)
            raise InvalidInputError(
                "frames", f"frames must be integer [n, {self.num_codebooks}], got {shape}"
            )
        if frames.numel() and (int(frames.min()) < 0 or int(frames.max()) >= self._codebook_size):
            raise InvalidInputError("frames", f"codes must be in [0, {self._codebook_size})")
        if already + frames.shape[0] > self._max_frames:
            raise InvalidInputError(
                "frames", f"more than {self._max_frames} frames ({MAX_DECODE_SECONDS} s)"
            )

    # -- engine contract ----------------------------------------------------------------------

    def prepare(self, request: EngineRequest) -> DecodeState:
        payload: DecodeInput = request.payload
        rule = ChunkRule(
            chunk_frames=payload.chunk_frames,
            initial_chunk_frames=payload.initial_chunk_frames,
            left_context_frames=payload.left_context_frames,
        )
        empty = torch.empty((0, self.num_codebooks), dtype=torch.long)
        state = DecodeState(request_id=request.request_id, tracker=ChunkTracker(rule), codes=empty)
        frames = payload.frames if payload.frames is not None else empty
        self._append(state, FramesInput(frames, payload.final))
        return state

    def add_input(self, state: DecodeState, payload: Any) -> None:
        if not isinstance(payload, FramesInput):
            raise TypeError(f"expected FramesInput, got {type(payload).__name__}")
        if state.final:
            raise InvalidInputError("frames", "frames arrived after the final frames")
        self._check_frames(payload.frames, already=state.received)
        self._append(state, payload)

    @torch.inference_mode()
    def step(self, states: Sequence[DecodeState]) -> list[StepOutput]:
        emissions = [s.tracker.next_emission(s.received, s.final) for s in states]
        audio = self._decode_batched(states, emissions)
        return [
            self._output(state, emission, audio.get(i))
            for i, (state, emission) in enumerate(zip(states, emissions, strict=True))
        ]

    def finish(self, state: DecodeState) -> DecodeResult:
        return DecodeResult(
            sample_rate=self.sample_rate, num_frames=state.received, num_samples=state.samples
        )

    def release(self, state: DecodeState) -> None:
        state.codes = torch.empty((0, self.num_codebooks), dtype=torch.long)

    def batch_key(self, state: DecodeState) -> Hashable:
        return self.stage

    # -- helpers ------------------------------------------------------------------------------

    def _append(self, state: DecodeState, payload: FramesInput) -> None:
        state.codes = torch.cat([state.codes, payload.frames.to(torch.long).cpu()])
        state.received += payload.frames.shape[0]
        state.final = payload.final

    def _decode_batched(
        self, states: Sequence[DecodeState], emissions: Sequence[Emission | None]
    ) -> dict[int, torch.Tensor]:
        """Decode every due chunk; chunks of equal length share one codec call."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, emission in enumerate(emissions):
            if emission is not None:
                groups[emission.frames_in_payload].append(i)
        audio: dict[int, torch.Tensor] = {}
        device = self._codec.device
        for members in groups.values():
            codes = torch.stack([self._payload(states[i], emissions[i]) for i in members])
            values = self._codec.decode(codes.transpose(1, 2).to(device)).audio_values[:, 0]
            for row, i in enumerate(members):
                trim = emissions[i].left_context_size * self.samples_per_frame
                audio[i] = values[row, trim:].float().cpu()
        return audio

    @staticmethod
    def _payload(state: DecodeState, emission: Emission | None) -> torch.Tensor:
        assert emission is not None
        return state.codes[emission.start - state.base : emission.end - state.base]

    def _output(
        self, state: DecodeState, emission: Emission | None, audio: torch.Tensor | None
    ) -> StepOutput:
        done = state.final and state.tracker.emitted == state.received
        if emission is None:
            return StepOutput(step_index=state.chunks, finished=done, waiting_for_input=not done)
        state.chunks += 1
        state.samples += 0 if audio is None else audio.shape[0]
        self._forget_old_frames(state)
        return StepOutput(step_index=state.chunks, partial=audio, finished=done)

    @staticmethod
    def _forget_old_frames(state: DecodeState) -> None:
        keep_from = max(state.base, state.tracker.emitted - state.tracker.rule.left_context_frames)
        state.codes = state.codes[keep_from - state.base :]
        state.base = keep_from


# -- encode -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodeInput:
    """A reference clip: mono float audio at any rate in [8 kHz, 192 kHz]."""

    audio: torch.Tensor | np.ndarray  # [samples] or [1, samples]
    sample_rate: int


@dataclass
class EncodeState:
    request_id: str
    audio: torch.Tensor | None  # [samples] at the codec's rate
    codes: torch.Tensor | None = None  # [frames, Q] once encoded


class CodecEncoderAdapter:
    """`StageAdapter[EncodeState]`: reference audio -> codec frames [n, Q], in a single step.

    Audio at another rate is resampled with a windowed-sinc (Hann, 16 zero crossings) polyphase
    filter whose cutoff sits just under the lower Nyquist frequency; see `resample`.
    """

    stage = "codec-encode"

    def __init__(self, model_dir: str | Path) -> None:
        self._codec = _load_codec(model_dir)
        self.sample_rate: int = self._codec.config.sampling_rate
        self.num_codebooks: int = self._codec.config.num_quantizers

    def check_inputs(self, payload: Any) -> None:
        if not isinstance(payload, EncodeInput):
            raise TypeError(f"expected EncodeInput, got {type(payload).__name__}")
        if not MIN_SAMPLE_RATE <= payload.sample_rate <= MAX_SAMPLE_RATE:
            raise InvalidInputError(
                "ref_audio",
                f"sample rate must be in [{MIN_SAMPLE_RATE}, {MAX_SAMPLE_RATE}] Hz, "
                f"got {payload.sample_rate}",
            )
        audio = torch.as_tensor(payload.audio)
        if audio.ndim == 2 and audio.shape[0] == 1:
            audio = audio[0]
        if audio.ndim != 1 or not audio.dtype.is_floating_point:
            raise InvalidInputError(
                "ref_audio",
                f"audio must be mono float samples, got {audio.dtype} {tuple(audio.shape)}",
            )
        if audio.numel() == 0:
            raise InvalidInputError("ref_audio", "audio is empty")
        seconds = audio.numel() / payload.sample_rate
        if seconds > MAX_REF_AUDIO_SECONDS:
            raise InvalidInputError(
                "ref_audio",
                f"audio is {seconds:.1f} s long, the limit is {MAX_REF_AUDIO_SECONDS} s",
            )
        if not bool(torch.isfinite(audio).all()):
            raise InvalidInputError("ref_audio", "audio contains NaN or infinite samples")

    def prepare(self, request: EngineRequest) -> EncodeState:
        payload: EncodeInput = request.payload
        audio = torch.as_tensor(payload.audio, dtype=torch.float32).reshape(-1)
        audio = resample(audio, payload.sample_rate, self.sample_rate)
        return EncodeState(request_id=request.request_id, audio=audio)

    def add_input(self, state: EncodeState, payload: Any) -> None:
        raise InvalidInputError("ref_audio", "encode takes its whole clip at the start")

    @torch.inference_mode()
    def step(self, states: Sequence[EncodeState]) -> list[StepOutput]:
        outputs = []
        for state in states:
            if state.audio is None:
                raise RuntimeError(f"request {state.request_id} was released")
            audio = state.audio.to(self._codec.device).view(1, 1, -1)
            codes = self._codec.encode(audio, num_quantizers=self.num_codebooks).audio_codes
            state.codes = codes[0].transpose(0, 1).to(torch.long).cpu()
            state.audio = None
            outputs.append(StepOutput(step_index=1, finished=True))
        return outputs

    def finish(self, state: EncodeState) -> torch.Tensor:
        assert state.codes is not None
        return state.codes

    def release(self, state: EncodeState) -> None:
        state.audio = None
        state.codes = None

    def batch_key(self, state: EncodeState) -> Hashable:
        return self.stage


def resample(
    audio: torch.Tensor, orig_rate: int, target_rate: int, zero_crossings: int = 16
) -> torch.Tensor:
    """Band-limited resampling of a 1-D signal by a rational factor.

    With g = gcd(orig, target), up = target/g and down = orig/g, output sample k*up + p lies at
    input time k*down + p*down/up. Each of the `up` phases is one FIR kernel (a Hann-windowed
    sinc with cutoff 0.97 * min(up, down)/2 cycles per unit), applied as one strided conv1d.
    """
    if orig_rate == target_rate:
        return audio
    g = math.gcd(orig_rate, target_rate)
    up, down = target_rate // g, orig_rate // g
    cutoff = 0.97 * min(up, down) / 2  # cycles per time unit, where one unit = down samples
    half_width = zero_crossings / (2 * cutoff)  # in time units
    pad = math.ceil(half_width * down)
    taps = torch.arange(2 * pad + down, dtype=torch.float64)
    phases = torch.arange(up, dtype=torch.float64)[:, None]
    t = (taps[None, :] - pad) / down - phases / up  # input time minus output time
    window = torch.where(
        t.abs() <= half_width, 0.5 + 0.5 * torch.cos(math.pi * t / half_width), 0.0
    )
    kernels = (2 * cutoff / down) * torch.sinc(2 * cutoff * t) * window
    padded = torch.nn.functional.pad(audio.to(torch.float64)[None, None], (pad, pad + down))
    out = torch.nn.functional.conv1d(padded, kernels[:, None, :], stride=down)
    length = math.ceil(audio.numel() * up / down)
    return out[0].transpose(0, 1).reshape(-1)[:length].to(audio.dtype)
