"""One typed record of stage stubs per task, built on the mesh's channels.

The generated `*_pb2_grpc.pyi` files say that a stub built on an aio channel is the stage's
`...AsyncStub`, so every call through these records is typed end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from stagemesh.shared.proto.v1 import (
    codec_service_pb2_grpc,
    dit_service_pb2_grpc,
    talker_service_pb2_grpc,
    tokenizer_service_pb2_grpc,
    transcriber_service_pb2_grpc,
    vae_service_pb2_grpc,
)

if TYPE_CHECKING:  # the async stub classes exist only in the generated .pyi files
    from stagemesh.shared.proto.v1.codec_service_pb2_grpc import CodecServiceAsyncStub
    from stagemesh.shared.proto.v1.dit_service_pb2_grpc import DitServiceAsyncStub
    from stagemesh.shared.proto.v1.talker_service_pb2_grpc import TalkerServiceAsyncStub
    from stagemesh.shared.proto.v1.tokenizer_service_pb2_grpc import TokenizerServiceAsyncStub
    from stagemesh.shared.proto.v1.transcriber_service_pb2_grpc import (
        TranscriberServiceAsyncStub,
    )
    from stagemesh.shared.proto.v1.vae_service_pb2_grpc import VaeServiceAsyncStub


@dataclass(frozen=True)
class ImageStubs:
    """The stages of a Tokenizer/DiT/VAE recipe (text-to-image, image-edit, video): the VAE
    stub has both DecodeLatents and EncodeImage."""

    tokenizer: TokenizerServiceAsyncStub
    dit: DitServiceAsyncStub
    vae: VaeServiceAsyncStub


@dataclass(frozen=True)
class SpeechStubs:
    """The stages of a text-to-speech recipe."""

    talker: TalkerServiceAsyncStub
    codec: CodecServiceAsyncStub


def tokenizer_stub(channel: grpc.aio.Channel) -> TokenizerServiceAsyncStub:
    return tokenizer_service_pb2_grpc.TokenizerServiceStub(channel)


def dit_stub(channel: grpc.aio.Channel) -> DitServiceAsyncStub:
    return dit_service_pb2_grpc.DitServiceStub(channel)


def vae_stub(channel: grpc.aio.Channel) -> VaeServiceAsyncStub:
    return vae_service_pb2_grpc.VaeServiceStub(channel)


def talker_stub(channel: grpc.aio.Channel) -> TalkerServiceAsyncStub:
    return talker_service_pb2_grpc.TalkerServiceStub(channel)


def codec_stub(channel: grpc.aio.Channel) -> CodecServiceAsyncStub:
    return codec_service_pb2_grpc.CodecServiceStub(channel)


def transcriber_stub(channel: grpc.aio.Channel) -> TranscriberServiceAsyncStub:
    return transcriber_service_pb2_grpc.TranscriberServiceStub(channel)
