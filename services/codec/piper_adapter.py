"""Codec stage for a Piper voice: latent z frames -> waveform, decoded incrementally.

The codec graph is VITS' HiFi-GAN decoder (`stagemesh.models.families.piper`): 256 samples per
z frame, and non-causal (each sample depends on frames on both sides). A chunk of new frames is
therefore decoded with up to `left_context_frames` frames before it and `right_context_frames`
after it, and the samples of the context frames are cropped. With 12 frames on each side the
concatenated chunks equal a one-shot decode of all frames to float precision (tests/model); the
decoder waits for the right context before it emits a chunk, except at the end of the input.

The first chunk is `initial_chunk_frames` long (time to first audio), the later ones
`chunk_frames` (fewer context frames decoded per new frame). The output gets the folder's fixed
gain (Piper's own per-sentence peak normalisation needs the whole sentence first) and is clipped
to [-1, 1].
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from stagemesh.models.families.piper import CODEC_INPUT, PiperVoiceFolder, open_session
from stagemesh.services.codec.chunking import ChunkRule
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StageAdapter,
    StepOutput,
)

Floats = npt.NDArray[np.float32]

#: Longest utterance one decode request may carry.
MAX_DECODE_SECONDS = 600
#: Option defaults, in frames (1 frame = 11.6 ms): 12 frames of context on each side make the
#: chunked decode exact; a 16-frame first chunk leaves after 28 frames have arrived.
DEFAULT_CHUNK_FRAMES = 48
DEFAULT_INITIAL_CHUNK_FRAMES = 16
DEFAULT_CONTEXT_FRAMES = 12


@dataclass(frozen=True)
class LatentDecodeInput:
    """Starts a decode; `frames` may already carry some z frames [n, channels]."""

    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    initial_chunk_frames: int = DEFAULT_INITIAL_CHUNK_FRAMES
    left_context_frames: int = DEFAULT_CONTEXT_FRAMES
    right_context_frames: int = DEFAULT_CONTEXT_FRAMES
    frames: Floats | None = None
    final: bool = False


@dataclass(frozen=True)
class LatentFramesInput:
    """More z frames [n, channels] (n may be 0 with final=True)."""

    frames: Floats
    final: bool = False


@dataclass(frozen=True)
class LatentDecodeResult:
    sample_rate: int
    num_frames: int
    num_samples: int


@dataclass
class LatentDecodeState:
    request_id: str
    rule: LatentDecodeInput  # its chunk and context sizes (frames unused after prepare)
    frames: Floats  # [kept, channels]: the frames from `base` on
    base: int = 0  # request frame index of frames[0]
    received: int = 0
    emitted: int = 0
    final: bool = False
    chunks: int = 0
    samples: int = 0


class PiperCodecAdapter:
    """The Codec stage's decoder for a Piper folder: streamed z frames -> float32 PCM."""

    stage = "codec"

    def __init__(self, model_dir: str | Path, *, threads: int = 1) -> None:
        self.folder = PiperVoiceFolder.load(model_dir)
        self._session = open_session(self.folder.codec_graph, threads)
        self.sample_rate = self.folder.sample_rate
        self.samples_per_frame = self.folder.hop_samples
        self.channels = self.folder.latent_channels
        self._max_frames = math.ceil(MAX_DECODE_SECONDS * self.folder.frame_rate)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: LatentDecodeInput) -> None:
        for name in ("chunk_frames", "initial_chunk_frames"):
            if getattr(payload, name) < 1:
                raise InvalidInputError(name, f"{name} must be >= 1, got {getattr(payload, name)}")
        for name in ("left_context_frames", "right_context_frames"):
            if getattr(payload, name) < 0:
                raise InvalidInputError(name, f"{name} must be >= 0, got {getattr(payload, name)}")
        if payload.frames is not None:
            self._check_frames(payload.frames, already=0)

    def _check_frames(self, frames: Floats, already: int) -> None:
        if frames.ndim != 2 or frames.shape[1] != self.channels or frames.dtype != np.float32:
            raise InvalidInputError(
                "frames", f"latent frames must be float32 [n, {self.channels}], "
                f"got {frames.dtype} {tuple(frames.shape)}")
        if not bool(np.isfinite(frames).all()):
            raise InvalidInputError("frames", "latent frames contain NaN or infinite values")
        if already + frames.shape[0] > self._max_frames:
            raise InvalidInputError(
                "frames", f"more than {self._max_frames} frames ({MAX_DECODE_SECONDS} s)")

    # -- engine contract ----------------------------------------------------------------------

    def prepare(self, request: EngineRequest[LatentDecodeInput]) -> LatentDecodeState:
        payload = request.payload
        empty = np.zeros((0, self.channels), dtype=np.float32)
        state = LatentDecodeState(request_id=request.request_id, rule=payload, frames=empty)
        frames = payload.frames if payload.frames is not None else empty
        self._append(state, LatentFramesInput(frames, payload.final))
        return state

    def add_input(self, state: LatentDecodeState, payload: LatentFramesInput) -> None:
        if state.final:
            raise InvalidInputError("frames", "frames arrived after the final frames")
        self._check_frames(payload.frames, already=state.received)
        self._append(state, payload)

    def step(self, states: Sequence[LatentDecodeState]) -> list[StepOutput[Floats]]:
        windows = [_window(state) for state in states]
        audio = [None if w is None else self.decode(_window_frames(s, w), w)
                 for s, w in zip(states, windows, strict=True)]
        return [self._output(s, w, a) for s, w, a in zip(states, windows, audio, strict=True)]

    def finish(self, state: LatentDecodeState) -> LatentDecodeResult:
        return LatentDecodeResult(sample_rate=self.sample_rate, num_frames=state.received,
                                  num_samples=state.samples)

    def release(self, state: LatentDecodeState) -> None:
        state.frames = np.zeros((0, self.channels), dtype=np.float32)

    def batch_key(self, state: LatentDecodeState) -> Hashable:
        return self.stage

    # -- model --------------------------------------------------------------------------------

    def decode(self, frames: Floats, window: _Window | None = None) -> Floats:
        """PCM of `frames` [n, channels] (a whole utterance, or a window whose context frames
        are cropped), with the fixed gain."""
        z = np.ascontiguousarray(frames.T[None])
        pcm = np.asarray(self._session.run(None, {CODEC_INPUT: z})[0], np.float32).reshape(-1)
        if window is not None:
            hop = self.samples_per_frame
            pcm = pcm[window.left * hop : (window.left + window.new) * hop]
        gained: Floats = np.clip(pcm * np.float32(self.folder.output_gain), -1.0, 1.0)
        return gained.astype(np.float32, copy=False)

    # -- helpers ------------------------------------------------------------------------------

    def _append(self, state: LatentDecodeState, payload: LatentFramesInput) -> None:
        state.frames = np.concatenate([state.frames, payload.frames.astype(np.float32)])
        state.received += payload.frames.shape[0]
        state.final = payload.final

    def _output(self, state: LatentDecodeState, window: _Window | None,
                audio: Floats | None) -> StepOutput[Floats]:
        if window is None or audio is None:
            done = state.final and state.emitted == state.received
            return StepOutput(step_index=state.chunks, finished=done, waiting_for_input=not done)
        state.chunks += 1
        state.samples += audio.shape[0]
        state.emitted += window.new
        keep_from = max(state.base, state.emitted - state.rule.left_context_frames)
        state.frames = state.frames[keep_from - state.base :]
        state.base = keep_from
        done = state.final and state.emitted == state.received
        return StepOutput(step_index=state.chunks, partial=audio, finished=done)


@dataclass(frozen=True)
class _Window:
    """One chunk to decode: `new` frames from `start + left`, with `left` and `right` context
    frames around them."""

    start: int  # request frame index of the window's first (context) frame
    left: int
    new: int
    right: int


def chunk_rule(payload: LatentDecodeInput) -> ChunkRule:
    """The request's emission rule: one first chunk of `initial_chunk_frames`, then
    `chunk_frames` each, with up to `left_context_frames` before each (`ChunkRule`)."""
    return ChunkRule(chunk_frames=payload.chunk_frames,
                     initial_chunk_frames=payload.initial_chunk_frames,
                     left_context_frames=payload.left_context_frames, initial_chunks=1)


def _window(state: LatentDecodeState) -> _Window | None:
    """The next chunk that can be decoded exactly now, or None (wait for frames): the rule's
    next chunk once its right context has arrived too (or the input has ended)."""
    right_context = state.rule.right_context_frames
    ready = state.received if state.final else state.received - right_context
    emission = chunk_rule(state.rule).next_emission(state.emitted, ready, state.final)
    if emission is None:
        return None
    right = min(right_context, state.received - emission.end)
    return _Window(start=emission.start, left=emission.left_context_size,
                   new=emission.new_frames, right=right)


def _window_frames(state: LatentDecodeState, window: _Window) -> Floats:
    start = window.start - state.base
    return state.frames[start : start + window.left + window.new + window.right]


#: The static proof that the adapter is the Codec stage's decode StageAdapter.
_: type[StageAdapter[LatentDecodeInput, LatentFramesInput, LatentDecodeState, Floats,
                     LatentDecodeResult]] = PiperCodecAdapter
