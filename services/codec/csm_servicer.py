"""Codec stage for CSM's Mimi codec: DecodeAudio takes codes, EncodeAudio clones a voice."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias, TypedDict

import torch

from stagemesh.services.codec.csm_adapter import (
    CPU_DTYPE,
    CodecDecoderAdapter,
    CodecEncoderAdapter,
    CodecLimits,
    DecodeInput,
    DecodeResult,
    DecodeState,
    EncodeInput,
    EncodeState,
    FramesInput,
)
from stagemesh.services.codec.servicer import (
    DEFAULT_MAX_RUNNING,
    CodecServicer,
    codec_bundle,
    decode_wire,
)
from stagemesh.shared.devices import DeviceOptions, Placement, resolve_placement
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError, NoStream
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.options import EngineOptions, parse_options
from stagemesh.shared.proto.v1 import codec_service_pb2 as pb
from stagemesh.shared.stage_runtime import StageBundle, stage_description
from stagemesh.shared.stage_stream import StageRoute, StageWire
from stagemesh.shared.tensors import TensorDecodeError, is_set
from stagemesh.shared.torch_tensors import from_proto, to_proto

DecoderEngine: TypeAlias = StepEngine[
    DecodeInput, FramesInput, DecodeState, torch.Tensor, DecodeResult
]
EncoderEngine: TypeAlias = StepEngine[EncodeInput, NoStream, EncodeState, NoStream, torch.Tensor]
EncodeAudioWire: TypeAlias = StageWire[
    pb.EncodeAudioRequest, pb.EncodeAudioResponse, EncodeInput, NoStream, NoStream, torch.Tensor
]
DecodeAudioWire: TypeAlias = StageWire[
    pb.DecodeAudioRequest, pb.DecodeAudioResponse, DecodeInput, FramesInput, torch.Tensor,
    DecodeResult,
]


class ChunkOptions(TypedDict, total=False):
    """Chunk sizes (in frames) for DecodeAudio requests that leave them 0."""

    chunk_frames: int
    initial_chunk_frames: int
    left_context_frames: int


class _DecodeWire:
    """DecodeAudio <-> the decoder engine, with the stage's default chunk sizes."""

    def __init__(self, adapter: CodecDecoderAdapter, defaults: DecodeInput) -> None:
        self._adapter = adapter
        self._defaults = defaults
        self.wire: DecodeAudioWire = decode_wire(
            self._payload, self._input, lambda pcm: to_proto(pcm.to(torch.float32)),
            adapter.sample_rate, adapter.samples_per_frame)

    def _payload(self, start: pb.DecodeAudioStart) -> DecodeInput:
        d = self._defaults
        return DecodeInput(
            chunk_frames=start.chunk_frames or d.chunk_frames,
            initial_chunk_frames=start.initial_chunk_frames or d.initial_chunk_frames,
            left_context_frames=start.left_context_frames or d.left_context_frames)

    def _input(self, message: pb.DecodeAudioRequest) -> FramesInput:
        frames = message.input
        if not is_set(frames.codes):  # unset: no frames (final=true)
            return FramesInput(frames=torch.empty((0, self._adapter.num_codebooks),
                                                  dtype=torch.long), final=frames.final)
        # An undecodable tensor raises TensorDecodeError: serve_stage_stream then ends the
        # request with INVALID_ARGUMENT.
        return FramesInput(frames=from_proto(frames.codes), final=frames.final)


def _clip_elements(limits: CodecLimits) -> int:
    """Most samples a legal reference clip has: the longest clip at the highest rate."""
    return math.ceil(limits.max_reference_seconds * max(limits.reference_sample_rates))


def _encode_wire(limits: CodecLimits) -> EncodeAudioWire:
    """EncodeAudio <-> the encoder engine. A clip's samples are decoded only up to the most a
    legal clip has, so an oversized one is refused before it is allocated; its rate and exact
    length are then checked by the adapter (`CodecEncoderAdapter.check_inputs`)."""
    max_elements = _clip_elements(limits)

    def make_request(
        message: pb.EncodeAudioRequest, deadline: float | None
    ) -> EngineRequest[EncodeInput]:
        start = message.start
        try:
            audio = from_proto(start.pcm, max_elements=max_elements)
        except TensorDecodeError as error:
            raise InvalidInputError("ref_audio", f"reference audio: {error}") from None
        return EngineRequest(request_id=start.request_id, deadline=deadline,
                             payload=EncodeInput(audio=audio, sample_rate=start.sample_rate))

    return StageWire(response_cls=pb.EncodeAudioResponse, make_request=make_request,
                     encode_result=_encode_result)


def _encode_result(codes: torch.Tensor) -> pb.EncodeAudioResult:
    return pb.EncodeAudioResult(codes=to_proto(codes))


def _describe(
    model_dir: Path, decoder: DecoderEngine, limits: CodecLimits, placement: Placement
) -> pb.DescribeCodecResponse:
    """The decoder's capacity (DecodeAudio is the stage's main work) and the codec's facts."""
    return pb.DescribeCodecResponse(
        stage=stage_description("codec", model_dir, decoder, placement),
        sample_rate=limits.sample_rate, frame_rate=limits.frame_rate,
        num_codebooks=limits.num_codebooks, max_reference_seconds=limits.max_reference_seconds,
        reference_sample_rates=limits.reference_sample_rates)


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """options: EngineOptions (max_running, default 8), ChunkOptions and DeviceOptions (one
    placement for both engines)."""
    engine_options, chunk_options, device_options = parse_options(
        "codec", options, EngineOptions, ChunkOptions, DeviceOptions)
    placement = resolve_placement("codec", device_options, CPU_DTYPE)
    defaults = DecodeInput(**chunk_options)
    decoder_adapter = CodecDecoderAdapter(model_dir, placement=placement)
    decoder_adapter.check_inputs(defaults)  # bad options fail at start-up, not per request
    decoder = StepEngine(decoder_adapter,
                         max_running=engine_options.get("max_running", DEFAULT_MAX_RUNNING))
    encoder_adapter = CodecEncoderAdapter(model_dir, placement=placement)
    encoder = StepEngine(encoder_adapter)
    servicer = CodecServicer(
        StageRoute(decoder, _DecodeWire(decoder_adapter, defaults).wire),
        StageRoute(encoder, _encode_wire(encoder_adapter.limits)),
        _describe(model_dir, decoder, encoder_adapter.limits, placement))
    return codec_bundle(model_dir, [decoder, encoder], servicer, {
        **placement.facts(), "chunk_frames": str(defaults.chunk_frames),
        "initial_chunk_frames": str(defaults.initial_chunk_frames),
        "left_context_frames": str(defaults.left_context_frames)})
