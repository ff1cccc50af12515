"""Codec stage servicer: DecodeAudio (streamed frames -> audio chunks) and EncodeAudio.

DecodeAudio takes its frames from `input` messages while the talker is still generating; the
decoder engine emits one AudioChunk whenever the async-chunk rule says a chunk is due. The two
RPCs run on two engines (labelled `codec` and `codec-encode` in metrics), so a reference clip
being encoded never waits behind a long decode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import torch

from stagemesh.services.codec.adapter import (
    CodecDecoderAdapter,
    CodecEncoderAdapter,
    DecodeInput,
    DecodeResult,
    EncodeInput,
    FramesInput,
)
from stagemesh.shared.engine.adapter import EngineRequest, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.proto.v1 import codec_service_pb2 as pb
from stagemesh.shared.proto.v1 import codec_service_pb2_grpc, common_pb2
from stagemesh.shared.stage_runtime import StageBundle
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.torch_tensors import from_proto, to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CodecService"].full_name
DEFAULT_MAX_RUNNING = 8


class _DecodeWire:
    """DecodeAudio <-> the decoder engine, with the stage's default chunk sizes."""

    def __init__(self, adapter: CodecDecoderAdapter, defaults: DecodeInput) -> None:
        self._adapter = adapter
        self._defaults = defaults
        self.wire = StageWire(response_cls=pb.DecodeAudioResponse, make_request=self._request,
                              encode_result=self._result, encode_partial=self._chunk,
                              make_input=self._input)

    def _request(self, start: pb.DecodeAudioStart, deadline: float | None) -> EngineRequest:
        d = self._defaults
        return EngineRequest(
            request_id=start.request_id, deadline=deadline,
            budget=StepBudget(total_steps=None),  # runs until its final frames are decoded
            payload=DecodeInput(
                chunk_frames=start.chunk_frames or d.chunk_frames,
                initial_chunk_frames=start.initial_chunk_frames or d.initial_chunk_frames,
                left_context_frames=start.left_context_frames or d.left_context_frames))

    def _input(self, message: pb.DecodeAudioInput) -> FramesInput:
        if message.codes.dtype == common_pb2.DTYPE_UNSPECIFIED:  # unset: no frames (final=true)
            return FramesInput(frames=torch.empty((0, self._adapter.num_codebooks),
                                                  dtype=torch.long), final=message.final)
        # An undecodable tensor raises TensorDecodeError: serve_stage_stream then ends the
        # request with INVALID_ARGUMENT.
        return FramesInput(frames=from_proto(message.codes), final=message.final)

    def _chunk(self, pcm: torch.Tensor) -> tuple[str, pb.AudioChunk]:
        return "chunk", pb.AudioChunk(
            pcm=to_proto(pcm.to(torch.float32)), sample_rate=self._adapter.sample_rate,
            frames=pcm.shape[0] // self._adapter.samples_per_frame)

    @staticmethod
    def _result(result: DecodeResult) -> pb.DecodeAudioResult:
        return pb.DecodeAudioResult(total_samples=result.num_samples,
                                    sample_rate=result.sample_rate)


def _encode_request(start: pb.EncodeAudioStart, deadline: float | None) -> EngineRequest:
    return EngineRequest(request_id=start.request_id, deadline=deadline,
                         payload=EncodeInput(audio=from_proto(start.pcm),
                                             sample_rate=start.sample_rate))


def _encode_result(codes: torch.Tensor) -> pb.EncodeAudioResult:
    return pb.EncodeAudioResult(codes=to_proto(codes))


ENCODE_WIRE = StageWire(response_cls=pb.EncodeAudioResponse, make_request=_encode_request,
                        encode_result=_encode_result)


class CodecServicer(codec_service_pb2_grpc.CodecServiceServicer):
    def __init__(self, decoder: StepEngine, decode_wire: StageWire, encoder: StepEngine) -> None:
        self.decoder = decoder
        self.decode_wire = decode_wire
        self.encoder = encoder

    async def DecodeAudio(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in serve_stage_stream(self.decoder, self.decode_wire,
                                                 request_iterator, context):
            yield response

    async def EncodeAudio(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in serve_stage_stream(self.encoder, ENCODE_WIRE, request_iterator,
                                                 context):
            yield response


def build_stage(model_dir: Path, options: dict[str, Any]) -> StageBundle:
    """options: max_running (default 8); chunk_frames, initial_chunk_frames and
    left_context_frames — the defaults for requests that leave them 0."""
    max_running = int(options.get("max_running", DEFAULT_MAX_RUNNING))
    base = DecodeInput()
    defaults = DecodeInput(
        chunk_frames=int(options.get("chunk_frames", base.chunk_frames)),
        initial_chunk_frames=int(options.get("initial_chunk_frames", base.initial_chunk_frames)),
        left_context_frames=int(options.get("left_context_frames", base.left_context_frames)))
    decoder_adapter = CodecDecoderAdapter(model_dir)
    decoder_adapter.check_inputs(defaults)  # bad options fail at start-up, not per request
    decoder = StepEngine(decoder_adapter, max_running=max_running)
    encoder = StepEngine(CodecEncoderAdapter(model_dir))
    servicer = CodecServicer(decoder, _DecodeWire(decoder_adapter, defaults).wire, encoder)
    return StageBundle(
        name="codec", engines=[decoder, encoder], service_names=[SERVICE_NAME],
        register=lambda server: codec_service_pb2_grpc.add_CodecServiceServicer_to_server(
            servicer, server),
        info={"model": str(model_dir), "max_running": str(max_running),
              "chunk_frames": str(defaults.chunk_frames),
              "initial_chunk_frames": str(defaults.initial_chunk_frames),
              "left_context_frames": str(defaults.left_context_frames)})
