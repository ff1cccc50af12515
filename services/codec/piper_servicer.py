"""Codec stage for a Piper voice: DecodeAudio takes latent z frames (`latents`).

EncodeAudio has nothing to run (a Piper decoder has no encoder, and the voice cannot clone): it
answers UNIMPLEMENTED, and Describe publishes no reference sample rates; the gateway never
calls it, because the talker publishes `supports_voice_clone` = false.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias, TypedDict

import numpy as np

from stagemesh.services.codec.piper_adapter import (
    Floats,
    LatentDecodeInput,
    LatentDecodeResult,
    LatentDecodeState,
    LatentFramesInput,
    PiperCodecAdapter,
)
from stagemesh.services.codec.servicer import (
    DEFAULT_MAX_RUNNING,
    CodecServicer,
    codec_bundle,
    decode_wire,
)
from stagemesh.shared.devices import CPU_FLOAT32, cpu_threads
from stagemesh.shared.engine.adapter import InvalidInputError
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import codec_service_pb2 as pb
from stagemesh.shared.stage_runtime import StageBundle, stage_description
from stagemesh.shared.stage_stream import StageRoute, StageWire
from stagemesh.shared.tensors import array_from_proto, array_to_proto, is_set

LatentDecoderEngine: TypeAlias = StepEngine[
    LatentDecodeInput, LatentFramesInput, LatentDecodeState, Floats, LatentDecodeResult
]
LatentDecodeWire: TypeAlias = StageWire[
    pb.DecodeAudioRequest, pb.DecodeAudioResponse, LatentDecodeInput, LatentFramesInput, Floats,
    LatentDecodeResult,
]


class LatentChunkOptions(TypedDict, total=False):
    """Chunk and context sizes (in frames) for DecodeAudio requests that leave them 0."""

    chunk_frames: int
    initial_chunk_frames: int
    left_context_frames: int
    right_context_frames: int


class _LatentDecodeWire:
    """DecodeAudio <-> the latent decoder engine, with the stage's default chunk sizes."""

    def __init__(self, adapter: PiperCodecAdapter, defaults: LatentDecodeInput) -> None:
        self._adapter = adapter
        self._defaults = defaults
        self.wire: LatentDecodeWire = decode_wire(
            self._payload, self._input, array_to_proto, adapter.sample_rate,
            adapter.samples_per_frame)

    def _payload(self, start: pb.DecodeAudioStart) -> LatentDecodeInput:
        d = self._defaults
        return LatentDecodeInput(
            chunk_frames=start.chunk_frames or d.chunk_frames,
            initial_chunk_frames=start.initial_chunk_frames or d.initial_chunk_frames,
            left_context_frames=start.left_context_frames or d.left_context_frames,
            right_context_frames=start.right_context_frames or d.right_context_frames)

    def _input(self, message: pb.DecodeAudioRequest) -> LatentFramesInput:
        frames = message.input
        if is_set(frames.codes):
            raise InvalidInputError("frames", "this codec decodes latent frames, not codes")
        if not is_set(frames.latents):  # unset: no frames (final=true)
            empty = np.zeros((0, self._adapter.channels), dtype=np.float32)
            return LatentFramesInput(frames=empty, final=frames.final)
        latents = array_from_proto(frames.latents)
        if latents.dtype != np.float32:
            raise InvalidInputError("frames", f"latent frames must be float32, got "
                                    f"{latents.dtype}")
        return LatentFramesInput(frames=latents.astype(np.float32, copy=False),
                                 final=frames.final)


def build_stage(model_dir: Path, options: Mapping[str, object], *,
                threads: int | None = None) -> StageBundle:
    """options: EngineOptions (max_running, default 8) and LatentChunkOptions; `threads`:
    ONNX Runtime intra-op threads (default: the stage's share, `cpu_threads`)."""
    engine_options, chunk_options = parse_options(
        "codec", options, EngineOptions, LatentChunkOptions)
    defaults = LatentDecodeInput(**chunk_options)
    threads = cpu_threads(threads)
    adapter = PiperCodecAdapter(model_dir, threads=threads)
    adapter.check_inputs(defaults)  # bad options fail at start-up, not per request
    decoder = StepEngine(adapter,
                         max_running=engine_options.get("max_running", DEFAULT_MAX_RUNNING))
    description = pb.DescribeCodecResponse(
        stage=stage_description("codec", model_dir, decoder, CPU_FLOAT32),
        sample_rate=adapter.sample_rate, frame_rate=adapter.folder.frame_rate,
        num_codebooks=0, max_reference_seconds=0.0, latent_channels=adapter.channels)
    servicer = CodecServicer(
        StageRoute(decoder, _LatentDecodeWire(adapter, defaults).wire), None, description)
    return codec_bundle(model_dir, [decoder], servicer, {
        "runtime": "onnxruntime", "threads": str(threads),
        **{name: str(value) for name, value in chunk_options.items()}})
