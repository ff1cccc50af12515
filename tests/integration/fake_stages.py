"""Fake stages for the gateway's integration tests, written once: in-process grpc.aio servicers
that publish chosen facts through their Describe RPCs and answer the stage streams with tiny
canned tensors (no model), and the helpers to serve them on loopback.

Imported by tests/integration/test_{gateway_fake_stages,gateway_security,edit_gateway,
video_gateway,gateway_paths}.py; a fake whose behaviour only one suite needs (a video VAE that
streams frames) stays in that suite, built on the helpers here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.grpc.api import GatewayServicer
from stagemesh.gateway.grpc.native import NativeApi
from stagemesh.gateway.wire.auth import ApiKeys
from stagemesh.shared.errors import abort_with
from stagemesh.shared.proto.v1 import (
    codec_service_pb2,
    codec_service_pb2_grpc,
    common_pb2,
    dit_service_pb2,
    dit_service_pb2_grpc,
    gateway_service_pb2_grpc,
    talker_service_pb2,
    talker_service_pb2_grpc,
    tokenizer_service_pb2,
    tokenizer_service_pb2_grpc,
    vae_service_pb2,
    vae_service_pb2_grpc,
)
from stagemesh.shared.server import start_server
from stagemesh.shared.tensors import array_to_proto

SAMPLES_PER_FRAME = 10
SAMPLE_RATE = 8_000

#: How each kind of stage's servicer is added to a server.
REGISTER: dict[str, Callable[[Any, grpc.aio.Server], None]] = {
    "tokenizer": tokenizer_service_pb2_grpc.add_TokenizerServiceServicer_to_server,
    "dit": dit_service_pb2_grpc.add_DitServiceServicer_to_server,
    "vae": vae_service_pb2_grpc.add_VaeServiceServicer_to_server,
    "talker": talker_service_pb2_grpc.add_TalkerServiceServicer_to_server,
    "codec": codec_service_pb2_grpc.add_CodecServiceServicer_to_server,
}


async def start_message(requests: AsyncIterator[Any]) -> Any:
    """The `start` of a stage stream (its first message)."""
    async for request in requests:
        return request.start
    raise AssertionError("the stream ended before its start message")


@contextlib.asynccontextmanager
async def cancel_watch(requests: AsyncIterator[Any]) -> AsyncIterator[asyncio.Event]:
    """Reads the rest of a stage stream while the fake works: the event is set when a cancel
    message arrives (as a real stage's stream reader does)."""
    cancelled = asyncio.Event()

    async def watch() -> None:
        async for message in requests:
            if message.HasField("cancel"):
                cancelled.set()

    watcher = asyncio.create_task(watch())
    try:
        yield cancelled
    finally:
        watcher.cancel()


def prompt_embeds() -> Any:
    """The tokenizer's canned answer: prompt embeddings of 2 tokens x 4 dims, all zero."""
    return tokenizer_service_pb2.EncodePromptResponse(
        result=tokenizer_service_pb2.EncodePromptResult(
            prompt_embeds=array_to_proto(np.zeros((1, 2, 4), np.float32))))


@dataclass
class FakeTokenizer(tokenizer_service_pb2_grpc.TokenizerServiceServicer):
    """Publishes its limits (input images only where `max_images` > 0); counts Describe calls
    and records each start."""

    max_prompt_chars: int = 100
    max_pending: int = 0
    max_images: int = 0
    max_image_pixels: int = 0
    describes: int = 0
    starts: list[Any] = field(default_factory=list)

    async def DescribeTokenizer(self, request: Any, context: Any) -> Any:
        self.describes += 1
        return tokenizer_service_pb2.DescribeTokenizerResponse(
            stage=common_pb2.StageDescription(stage="tokenizer", max_pending=self.max_pending),
            max_prompt_chars=self.max_prompt_chars, max_sequence_length=64,
            max_images=self.max_images, max_image_pixels=self.max_image_pixels)

    async def EncodePrompt(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        self.starts.append(await start_message(requests))
        yield prompt_embeds()


@dataclass
class FakeDit(dit_service_pb2_grpc.DitServiceServicer):
    max_steps: int = 10
    fail_at_step: int | None = None  # INVALID_ARGUMENT naming `seed` after this step
    fail_seed: int | None = None  # fail only the request of this seed (None: every request)
    preempt_at_step: int | None = None  # a `preempted` event after this step
    step_seconds: dict[int, float] = field(default_factory=dict)  # per seed; default 0
    step_cache: str = "off"  # published with its threshold and the largest a request may set
    step_cache_threshold: float = 0.0
    max_step_cache_threshold: float = 0.0
    reused_steps: frozenset[int] = frozenset()  # steps whose progress says `reused`
    max_preview_size: int = 0  # > 0: it makes previews (grey 4 x 6, the step as its level)
    describes: int = 0
    starts: list[Any] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0  # requests denoising at once, at most
    cancelled: list[str] = field(default_factory=list)  # request ids whose RPC was cancelled
    lora_names: tuple[str, ...] = ("ink", "wax")  # two per request, |scale| <= 2

    async def DescribeDit(self, request: Any, context: Any) -> Any:
        self.describes += 1
        return dit_service_pb2.DescribeDitResponse(
            stage=common_pb2.StageDescription(stage="dit"), size_multiple=8, max_side=64,
            max_pixels=64 * 64, max_steps=self.max_steps, max_true_cfg_scale=5.0,
            max_images_per_request=2,
            execution_modes=[common_pb2.EXECUTION_MODE_STEP, common_pb2.EXECUTION_MODE_REQUEST],
            step_cache=self.step_cache, step_cache_threshold=self.step_cache_threshold,
            max_step_cache_threshold=self.max_step_cache_threshold,
            max_preview_size=self.max_preview_size, default_preview_size=self.max_preview_size // 2,
            min_preview_every=1 if self.max_preview_size else 0,
            lora_names=self.lora_names, max_loras_per_request=2, max_lora_scale=2.0)

    async def Denoise(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = await start_message(requests)
        self.starts.append(start)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield dit_service_pb2.DenoiseResponse(queued=common_pb2.Queued(position=0))
            for step in range(1, start.num_inference_steps + 1):
                await asyncio.sleep(self.step_seconds.get(start.seed, 0.0))
                yield dit_service_pb2.DenoiseResponse(progress=common_pb2.Progress(
                    step_index=step, total_steps=start.num_inference_steps,
                    reused=step in self.reused_steps))
                if start.preview.every and step % start.preview.every == 0:
                    yield dit_service_pb2.DenoiseResponse(preview=common_pb2.Preview(
                        step_index=step, width=6, height=4,
                        pixels=array_to_proto(np.full((4, 6, 3), step, np.uint8))))
                if step == self.preempt_at_step:
                    yield dit_service_pb2.DenoiseResponse(
                        preempted=common_pb2.Preempted(step_index=step))
                if step == self.fail_at_step and self.fail_seed in (None, start.seed):
                    await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "bad seed",
                                     reason="INVALID_ARGUMENT", field_name="seed")
            yield dit_service_pb2.DenoiseResponse(result=dit_service_pb2.DenoiseResult(
                latents=array_to_proto(np.full((1, 1), start.seed, np.float32)),
                height=start.height, width=start.width, steps=start.num_inference_steps))
        except asyncio.CancelledError:
            self.cancelled.append(start.request_id)
            raise
        finally:
            self.in_flight -= 1


@dataclass
class FakeVae(vae_service_pb2_grpc.VaeServiceServicer):
    """Decodes to one flat image of `level`; with `can_encode`, encodes an input image to
    canned latents (1, 4, 1, 2, 2) of 7.0. Records each start."""

    size_multiple: int = 16
    max_side: int = 48
    max_pending: int = 0
    can_encode: bool = False
    level: int = 200
    condition_area: int = 0  # what it publishes: 0, the stock edit pipeline's
    encodes: list[Any] = field(default_factory=list)
    decodes: list[Any] = field(default_factory=list)

    async def DescribeVae(self, request: Any, context: Any) -> Any:
        return vae_service_pb2.DescribeVaeResponse(
            stage=common_pb2.StageDescription(stage="vae", max_pending=self.max_pending),
            size_multiple=self.size_multiple, max_side=self.max_side,
            can_encode=self.can_encode, condition_area=self.condition_area)

    async def DecodeLatents(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = await start_message(requests)
        self.decodes.append(start)
        pixels = np.full((1, start.height, start.width, 3), self.level, np.uint8)
        yield vae_service_pb2.DecodeLatentsResponse(
            result=vae_service_pb2.DecodeLatentsResult(pixels=array_to_proto(pixels)))

    async def EncodeImage(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        self.encodes.append(await start_message(requests))
        yield vae_service_pb2.EncodeImageResponse(queued=common_pb2.Queued(position=0))
        latents = array_to_proto(np.full((1, 4, 1, 2, 2), 7.0, np.float32))
        yield vae_service_pb2.EncodeImageResponse(
            result=vae_service_pb2.EncodeImageResult(latents=latents))


@dataclass
class FakeTalker(talker_service_pb2_grpc.TalkerServiceServicer):
    """Voices ava and bo (and clones); codes of zeros, two frames a chunk. Records starts."""

    max_pending: int = 0
    starts: list[Any] = field(default_factory=list)

    async def DescribeTalker(self, request: Any, context: Any) -> Any:
        return talker_service_pb2.DescribeTalkerResponse(
            stage=common_pb2.StageDescription(stage="talker", max_pending=self.max_pending),
            voices=["ava", "bo"], default_voice="ava", supports_voice_clone=True,
            max_input_chars=50, max_reference_text_chars=20, max_new_frames=12,
            default_max_new_frames=4, frame_rate=12.5, max_temperature=3.0, max_top_k=100)

    async def GenerateFrames(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = await start_message(requests)
        self.starts.append(start)
        frames = start.sampling.max_new_frames or 4
        for first in range(0, frames, 2):
            yield talker_service_pb2.GenerateFramesResponse(frames=talker_service_pb2.CodecFrames(
                codes=array_to_proto(np.zeros((2, 8), np.int64)), first_frame_index=first))
        result = talker_service_pb2.GenerateFramesResult(total_frames=frames,
                                                         finish_reason="length")
        yield talker_service_pb2.GenerateFramesResponse(result=result)


@dataclass
class FakeCodec(codec_service_pb2_grpc.CodecServiceServicer):
    """SAMPLES_PER_FRAME samples of 0.25 per frame at SAMPLE_RATE; encodes a reference to 3
    frames of zeros."""

    max_pending: int = 0

    async def DescribeCodec(self, request: Any, context: Any) -> Any:
        return codec_service_pb2.DescribeCodecResponse(
            stage=common_pb2.StageDescription(stage="codec", max_pending=self.max_pending),
            sample_rate=SAMPLE_RATE, frame_rate=12.5, num_codebooks=8,
            max_reference_seconds=2.0, reference_sample_rates=[SAMPLE_RATE])

    async def DecodeAudio(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        total = 0
        async for request in requests:
            if request.HasField("input") and request.input.HasField("codes"):
                samples = request.input.codes.shape[0] * SAMPLES_PER_FRAME
                total += samples
                yield codec_service_pb2.DecodeAudioResponse(chunk=codec_service_pb2.AudioChunk(
                    pcm=array_to_proto(np.full(samples, 0.25, np.float32)),
                    sample_rate=SAMPLE_RATE))
            if request.HasField("input") and request.input.final:
                break
        yield codec_service_pb2.DecodeAudioResponse(result=codec_service_pb2.DecodeAudioResult(
            total_samples=total, sample_rate=SAMPLE_RATE))

    async def EncodeAudio(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        await start_message(requests)
        yield codec_service_pb2.EncodeAudioResponse(result=codec_service_pb2.EncodeAudioResult(
            codes=array_to_proto(np.zeros((3, 8), np.int64))))


async def serve_fake(kind: str, servicer: Any, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """`servicer` (a stage of `kind`: a REGISTER key) served on 127.0.0.1:`port` (0: a free
    one); the server and its port."""
    # gRPC shares a port between servers by default (SO_REUSEPORT): a second fake on a busy
    # port must fail to bind, not answer half the calls meant for the first
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    REGISTER[kind](servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert port in (0, bound), f"port {port} is taken"
    await server.start()
    return server, bound


async def serve_fakes(servicers: Mapping[str, Any]) -> tuple[dict[str, grpc.aio.Server],
                                                            dict[str, str]]:
    """Each servicer on a free port, by name (a name's last `-` part is its kind: `i2v-dit` is
    a DiT): the servers and their addresses."""
    servers, addresses = {}, {}
    for name, servicer in servicers.items():
        servers[name], port = await serve_fake(name.rsplit("-", 1)[-1], servicer)
        addresses[name] = f"127.0.0.1:{port}"
    return servers, addresses


async def stop_all(servers: Mapping[str, grpc.aio.Server]) -> None:
    for server in servers.values():
        await server.stop(0)


@contextlib.asynccontextmanager
async def gateway_stub(core: GatewayCore, keys: ApiKeys | None = None
                       ) -> AsyncIterator[gateway_service_pb2_grpc.GatewayServiceAsyncStub]:
    """The public gRPC API (GatewayServicer, checking `keys` if given) over `core`, served on a
    free port for the block, and a client stub of it."""
    running = await start_server(
        lambda server: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(
            GatewayServicer(NativeApi(core), keys), server), [])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield gateway_service_pb2_grpc.GatewayServiceStub(channel)
    finally:
        await running.stop(0)
