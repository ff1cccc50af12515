"""Codec stage servicer, one for every model family: DecodeAudio (streamed frames -> audio
chunks), EncodeAudio (a reference clip -> frames, for voice cloning) and DescribeCodec, over the
family's engines and wires (`csm_servicer`, `piper_servicer`).

DecodeAudio takes its frames from `input` messages while the talker is still generating; the
decoder engine emits one AudioChunk whenever the family's chunk rule says a chunk is due. The two
RPCs run on two engines (labelled `codec` and `codec-encode` in metrics), so a reference clip
being encoded never waits behind a long decode. A family without an encoder answers EncodeAudio
with UNIMPLEMENTED (its talker publishes `supports_voice_clone` = false, so the gateway never
calls it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol, TypeVar

import grpc

from stagemesh.shared.engine.adapter import EngineRequest, InputT, StepBudget, StreamT
from stagemesh.shared.proto.v1 import codec_service_pb2 as pb
from stagemesh.shared.proto.v1 import codec_service_pb2_grpc, common_pb2
from stagemesh.shared.stage_runtime import StageBundle, StageEngine, servicer_bundle
from stagemesh.shared.stage_stream import StageWire, StreamHandler

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CodecService"].full_name
#: Requests that share each decode step unless the recipe sets `max_running`.
DEFAULT_MAX_RUNNING = 8
_NO_RESPONSES: tuple[pb.EncodeAudioResponse, ...] = ()

DecodeAudioHandler = StreamHandler[pb.DecodeAudioRequest, pb.DecodeAudioResponse]
EncodeAudioHandler = StreamHandler[pb.EncodeAudioRequest, pb.EncodeAudioResponse]


class Pcm(Protocol):
    """A chunk of decoded samples, [samples] first (a torch tensor or a numpy array)."""

    @property
    def shape(self) -> tuple[int, ...]: ...


class DecodeSummary(Protocol):
    """What a family's decoder reports when a decode has finished."""

    @property
    def sample_rate(self) -> int: ...

    @property
    def num_samples(self) -> int: ...


PcmT = TypeVar("PcmT", bound=Pcm)
SummaryT = TypeVar("SummaryT", bound=DecodeSummary)


def decode_wire(
    make_payload: Callable[[pb.DecodeAudioStart], InputT],
    make_input: Callable[[pb.DecodeAudioRequest], StreamT],
    pcm_to_proto: Callable[[PcmT], common_pb2.Tensor],
    sample_rate: int,
    samples_per_frame: int,
) -> StageWire[pb.DecodeAudioRequest, pb.DecodeAudioResponse, InputT, StreamT, PcmT, SummaryT]:
    """DecodeAudio <-> a family's decoder engine: the family reads its start (`make_payload`,
    e.g. chunk sizes with the stage's defaults) and its frames (`make_input`) and encodes its
    samples; every request runs until its final frames are decoded, a chunk per partial."""

    def make_request(message: pb.DecodeAudioRequest,
                     deadline: float | None) -> EngineRequest[InputT]:
        return EngineRequest(request_id=message.start.request_id, deadline=deadline,
                             budget=StepBudget(total_steps=None),
                             payload=make_payload(message.start))

    def encode_chunk(pcm: PcmT) -> pb.DecodeAudioResponse:
        return pb.DecodeAudioResponse(chunk=pb.AudioChunk(
            pcm=pcm_to_proto(pcm), sample_rate=sample_rate,
            frames=pcm.shape[0] // samples_per_frame))

    def encode_result(result: SummaryT) -> pb.DecodeAudioResult:
        return pb.DecodeAudioResult(total_samples=result.num_samples,
                                    sample_rate=result.sample_rate)

    return StageWire(response_cls=pb.DecodeAudioResponse, make_request=make_request,
                     encode_result=encode_result, encode_partial=encode_chunk,
                     make_input=make_input)


class CodecServicer(codec_service_pb2_grpc.CodecServiceServicer):
    def __init__(self, decode: DecodeAudioHandler, encode: EncodeAudioHandler | None,
                 description: pb.DescribeCodecResponse) -> None:
        self.decode = decode
        self.encode = encode
        self.description = description

    async def DecodeAudio(
        self,
        request_iterator: AsyncIterator[pb.DecodeAudioRequest],
        context: grpc.aio.ServicerContext[pb.DecodeAudioRequest, pb.DecodeAudioResponse],
    ) -> AsyncIterator[pb.DecodeAudioResponse]:
        async for response in self.decode(request_iterator, context):
            yield response

    async def EncodeAudio(
        self,
        request_iterator: AsyncIterator[pb.EncodeAudioRequest],
        context: grpc.aio.ServicerContext[pb.EncodeAudioRequest, pb.EncodeAudioResponse],
    ) -> AsyncIterator[pb.EncodeAudioResponse]:
        if self.encode is None:
            context.set_code(grpc.StatusCode.UNIMPLEMENTED)
            context.set_details("this codec cannot encode audio (the voice cannot clone)")
            for response in _NO_RESPONSES:  # a stream that ends at once, with that status
                yield response
            return
        async for response in self.encode(request_iterator, context):
            yield response

    async def DescribeCodec(
        self,
        request: pb.DescribeCodecRequest,
        context: grpc.aio.ServicerContext[pb.DescribeCodecRequest, pb.DescribeCodecResponse],
    ) -> pb.DescribeCodecResponse:
        return self.description


def codec_bundle(model_dir: Path, engines: list[StageEngine], servicer: CodecServicer,
                 info: dict[str, str]) -> StageBundle:
    """The Codec stage of any family: its engines (the decoder's first), the servicer, and
    facts for the logs (`info`, after the model and the decoder's capacity)."""
    return servicer_bundle("codec", model_dir, engines, servicer,
                        codec_service_pb2_grpc.add_CodecServiceServicer_to_server, SERVICE_NAME,
                        info)
