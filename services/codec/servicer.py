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

from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from stagemesh.shared.proto.v1 import codec_service_pb2 as pb
from stagemesh.shared.proto.v1 import codec_service_pb2_grpc
from stagemesh.shared.stage_runtime import StageBundle, StageEngine
from stagemesh.shared.stage_stream import StreamHandler

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CodecService"].full_name
#: Requests that share each decode step unless the recipe sets `max_running`.
DEFAULT_MAX_RUNNING = 8
_NO_RESPONSES: tuple[pb.EncodeAudioResponse, ...] = ()

DecodeAudioHandler = StreamHandler[pb.DecodeAudioRequest, pb.DecodeAudioResponse]
EncodeAudioHandler = StreamHandler[pb.EncodeAudioRequest, pb.EncodeAudioResponse]


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
    return StageBundle(
        name="codec", engines=engines, service_names=[SERVICE_NAME],
        register=lambda server: codec_service_pb2_grpc.add_CodecServiceServicer_to_server(
            servicer, server),
        info={"model": str(model_dir), "max_running": str(engines[0].max_running), **info})
