"""Codec stage: Mimi codec frames <-> audio (`transformers.MimiModel`).

`CodecDecoderAdapter` decodes frames incrementally while the talker is still producing them:
frames arrive through `add_input`, and a step decodes one chunk whenever the async-chunk rule
(`stagemesh.services.codec.chunking`) says so. Each chunk is decoded with up to
`left_context_frames` earlier frames in front and those frames' samples trimmed, so the
concatenated chunks equal a one-shot decode of all frames (Mimi's decoder is causal; the
context covers its receptive field).

`CodecEncoderAdapter` turns a reference clip into codec frames (voice cloning), in one step.
It accepts clips at the common sample rates of `REFERENCE_SAMPLE_RATES` only; one at another
rate than the codec's own is resampled by `resample`, a band-limited polyphase filter.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import MimiModel

from stagemesh.models.families.csm import codec_dir
from stagemesh.services.codec.chunking import ChunkRule, ChunkTracker, Emission
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)

#: Longest utterance one decode request may carry, and longest reference clip to encode.
MAX_DECODE_SECONDS = 600
MAX_REFERENCE_SECONDS = 30.0
#: The sample rates a reference clip may have: the common rates of audio files and devices.
REFERENCE_SAMPLE_RATES = (8_000, 11_025, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
#: The stage's default dtype on a CPU (`stagemesh.shared.devices.CpuDtype`), from `stagemesh
#: bench dtypes` (1 thread, 20 rounds interleaved) on a 5-frame then a 25-frame chunk with
#: csm-tiny's Mimi; best float32 / best bfloat16, median per-round bf16 speed-up:
#: Xeon with AMX-BF16 66.3 / 98.7 ms, 0.67x (again 71.5 / 107.2 ms, 0.71x) -> float32;
#: the same CPU held to AVX2 (no bfloat16 instructions) 47.3 / 82.6 ms, 0.59x -> float32.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)


@dataclass(frozen=True)
class CodecLimits:
    """The codec's audio format and what EncodeAudio accepts (its Describe facts)."""

    sample_rate: int  # of the audio it decodes (and encodes)
    frame_rate: float  # codec frames per second
    num_codebooks: int  # codes per frame
    max_reference_seconds: float
    reference_sample_rates: tuple[int, ...]


def _load_codec(model_dir: str | Path, placement: Placement) -> MimiModel:
    # from_pretrained leaves the model in eval mode.
    return MimiModel.from_pretrained(
        codec_dir(model_dir),
        local_files_only=True,
        dtype=placement.dtype,
        device_map=placement.device_name,
    )


def _codec_limits(codec: MimiModel) -> CodecLimits:
    config = codec.config
    return CodecLimits(
        sample_rate=config.sampling_rate,
        frame_rate=float(config.frame_rate),
        num_codebooks=config.num_quantizers,
        max_reference_seconds=MAX_REFERENCE_SECONDS,
        reference_sample_rates=REFERENCE_SAMPLE_RATES,
    )


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
    """The Codec stage's decoder: streamed codec frames -> float32 PCM chunks."""

    stage = "codec"

    def __init__(self, model_dir: str | Path, *, placement: Placement = CPU_FLOAT32) -> None:
        """placement: where Mimi decodes, and in what dtype; PCM leaves as float32 on the CPU
        whatever it is."""
        self._codec = _load_codec(model_dir, placement)
        self.placement = placement
        self.limits = _codec_limits(self._codec)
        self.sample_rate = self.limits.sample_rate
        self.samples_per_frame = round(self.sample_rate / self.limits.frame_rate)
        self.num_codebooks = self.limits.num_codebooks
        self._codebook_size: int = self._codec.config.codebook_size
        self._max_frames = math.ceil(MAX_DECODE_SECONDS * self.limits.frame_rate)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: DecodeInput) -> None:
        sizes = (
            ("chunk_frames", payload.chunk_frames),
            ("initial_chunk_frames", payload.initial_chunk_frames),
        )
        for name, value in sizes:
            if value < 1:
                raise InvalidInputError(name, f"{name} must be >= 1, got {value}")
        if payload.left_context_frames < 0:
            raise InvalidInputError(
                "left_context_frames",
                f"left_context_frames must be >= 0, got {payload.left_context_frames}",
            )
        if payload.frames is not None:
            self._check_frames(payload.frames, already=0)

    def _check_frames(self, frames: torch.Tensor, already: int) -> None:
        if (
            frames.ndim != 2
            or frames.shape[1] != self.num_codebooks
            or frames.dtype.is_floating_point
            or frames.dtype == torch.bool
        ):
            raise InvalidInputError(
                "frames",
                f"frames must be integer [n, {self.num_codebooks}], "
                f"got {frames.dtype} {tuple(frames.shape)}",
            )
        if frames.numel() and (int(frames.min()) < 0 or int(frames.max()) >= self._codebook_size):
            raise InvalidInputError("frames", f"codes must be in [0, {self._codebook_size})")
        if already + frames.shape[0] > self._max_frames:
            raise InvalidInputError(
                "frames", f"more than {self._max_frames} frames ({MAX_DECODE_SECONDS} s)"
            )

    # -- engine contract ----------------------------------------------------------------------

    def prepare(self, request: EngineRequest[DecodeInput]) -> DecodeState:
        payload = request.payload
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

    def add_input(self, state: DecodeState, payload: FramesInput) -> None:
        if state.final:
            raise InvalidInputError("frames", "frames arrived after the final frames")
        self._check_frames(payload.frames, already=state.received)
        self._append(state, payload)

    @torch.inference_mode()
    def step(self, states: Sequence[DecodeState]) -> list[StepOutput[torch.Tensor]]:
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
        groups: dict[int, list[tuple[int, Emission]]] = defaultdict(list)
        for i, emission in enumerate(emissions):
            if emission is not None:
                groups[emission.frames_in_payload].append((i, emission))
        audio: dict[int, torch.Tensor] = {}
        device = self._codec.device
        for members in groups.values():
            codes = torch.stack([_chunk_codes(states[i], emission) for i, emission in members])
            decoded = self._codec.decode(codes.transpose(1, 2).to(device))
            if decoded.audio_values is None:
                raise RuntimeError("the codec decoded no audio")
            values = decoded.audio_values[:, 0]
            for row, (i, emission) in enumerate(members):
                trim = emission.left_context_size * self.samples_per_frame
                audio[i] = values[row, trim:].float().cpu()
        return audio

    def _output(
        self, state: DecodeState, emission: Emission | None, audio: torch.Tensor | None
    ) -> StepOutput[torch.Tensor]:
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


def _chunk_codes(state: DecodeState, emission: Emission) -> torch.Tensor:
    """The frames one emission decodes, context included."""
    return state.codes[emission.start - state.base : emission.end - state.base]


# -- encode -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodeInput:
    """A reference clip: mono float samples at one of REFERENCE_SAMPLE_RATES."""

    audio: torch.Tensor  # [samples] or [1, samples]
    sample_rate: int


@dataclass
class EncodeState:
    request_id: str
    audio: torch.Tensor | None  # [samples] at the codec's rate
    codes: torch.Tensor | None = None  # [frames, Q] once encoded


class CodecEncoderAdapter:
    """The Codec stage's encoder: a reference clip -> codec frames [n, Q], in a single step.

    A clip at another of the reference rates than the codec's own is resampled first (see
    `resample`).
    """

    stage = "codec-encode"

    def __init__(self, model_dir: str | Path, *, placement: Placement = CPU_FLOAT32) -> None:
        """placement: where Mimi encodes, and in what dtype (a clip is resampled on the CPU
        in float64 first); codes leave as int64."""
        self._codec = _load_codec(model_dir, placement)
        self.placement = placement
        self.limits = _codec_limits(self._codec)
        self.sample_rate = self.limits.sample_rate
        self.num_codebooks = self.limits.num_codebooks

    def check_inputs(self, payload: EncodeInput) -> None:
        rates = self.limits.reference_sample_rates
        if payload.sample_rate not in rates:
            raise InvalidInputError(
                "ref_audio",
                f"sample rate must be one of {list(rates)} Hz, got {payload.sample_rate}",
            )
        audio = payload.audio
        if audio.ndim == 2 and audio.shape[0] == 1:
            audio = audio[0]
        if audio.ndim != 1 or not audio.dtype.is_floating_point:
            raise InvalidInputError(
                "ref_audio",
                f"audio must be mono float samples, got {audio.dtype} {tuple(audio.shape)}",
            )
        if audio.numel() == 0:
            raise InvalidInputError("ref_audio", "audio is empty")
        seconds, limit = audio.numel() / payload.sample_rate, self.limits.max_reference_seconds
        if seconds > limit:
            raise InvalidInputError(
                "ref_audio", f"audio is {seconds:.1f} s long, the limit is {limit:g} s"
            )
        if not bool(torch.isfinite(audio).all()):
            raise InvalidInputError("ref_audio", "audio contains NaN or infinite samples")

    def prepare(self, request: EngineRequest[EncodeInput]) -> EncodeState:
        payload = request.payload
        audio = payload.audio.to(torch.float32).reshape(-1)
        audio = resample(audio, payload.sample_rate, self.sample_rate)
        return EncodeState(request_id=request.request_id, audio=audio)

    def add_input(self, state: EncodeState, payload: NoStream) -> None:
        assert_never(payload)  # encode takes its whole clip at the start

    @torch.inference_mode()
    def step(self, states: Sequence[EncodeState]) -> list[StepOutput[NoStream]]:
        outputs: list[StepOutput[NoStream]] = []
        for state in states:
            if state.audio is None:
                raise RuntimeError(f"request {state.request_id} was released")
            audio = state.audio.to(self.placement.device, self._codec.dtype).view(1, 1, -1)
            encoded = self._codec.encode(audio, num_quantizers=self.num_codebooks)
            if not isinstance(encoded.audio_codes, torch.Tensor):
                raise RuntimeError("the codec returned no codes")
            state.codes = encoded.audio_codes[0].transpose(0, 1).to(torch.long).cpu()
            state.audio = None
            outputs.append(StepOutput(step_index=1, finished=True))
        return outputs

    def finish(self, state: EncodeState) -> torch.Tensor:
        if state.codes is None:
            raise RuntimeError("finish() before the encoding step ran")
        return state.codes

    def release(self, state: EncodeState) -> None:
        state.audio = None
        state.codes = None

    def batch_key(self, state: EncodeState) -> Hashable:
        return self.stage


#: Elements of conv1d's largest temporary per block (its unfolded input, float64): 8 MiB.
_BLOCK_ELEMENTS = 1 << 20


def resample(
    audio: torch.Tensor, orig_rate: int, target_rate: int, zero_crossings: int = 16
) -> torch.Tensor:
    """Band-limited resampling of a 1-D signal by a rational factor.

    With g = gcd(orig, target), up = target/g and down = orig/g, output sample k*up + p lies at
    input time k*down + p*down/up. Each of the `up` phases is one FIR kernel (a Hann-windowed
    sinc with cutoff 0.97 * min(up, down)/2 cycles per unit), applied as one strided conv1d.

    The conv runs over blocks of output units, so its unfolded input (taps x units, float64)
    stays under `_BLOCK_ELEMENTS` whatever the clip length: at 48 kHz -> 24 kHz (68 taps) a
    30 s clip in one conv would unfold to about 390 MB.
    """
    if orig_rate == target_rate:
        return audio
    g = math.gcd(orig_rate, target_rate)
    up, down = target_rate // g, orig_rate // g
    kernels, pad = _polyphase_kernels(up, down, zero_crossings)
    taps = kernels.shape[-1]
    length = math.ceil(audio.numel() * up / down)
    units = math.ceil(length / up)  # output unit k holds samples k*up .. k*up + up - 1
    padded = torch.nn.functional.pad(audio.reshape(1, 1, -1), (pad, pad + down))
    out = torch.empty((up, units), dtype=audio.dtype)
    block = max(1, _BLOCK_ELEMENTS // taps)
    for start in range(0, units, block):
        stop = min(units, start + block)
        segment = padded[..., start * down : (stop - 1) * down + taps].to(torch.float64)
        out[:, start:stop] = torch.nn.functional.conv1d(segment, kernels, stride=down)[0]
    return out.transpose(0, 1).reshape(-1)[:length]


def _polyphase_kernels(up: int, down: int, zero_crossings: int) -> tuple[torch.Tensor, int]:
    """[up, 1, taps] float64 FIR kernels (one per output phase) and the input padding."""
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
    return kernels[:, None, :], pad


#: The static proofs that the adapters are the Codec stage's StageAdapters.
_decoder: type[StageAdapter[DecodeInput, FramesInput, DecodeState, torch.Tensor, DecodeResult]] = (
    CodecDecoderAdapter
)
_encoder: type[StageAdapter[EncodeInput, NoStream, EncodeState, NoStream, torch.Tensor]] = (
    CodecEncoderAdapter
)
