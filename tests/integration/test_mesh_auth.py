"""The mesh credential on real stages: a stage started with a mesh token serves only calls that
carry it (the gateway's channels, opened by `open_channel`), while health and reflection stay
open; the token comes from the environment or a file, and `serve` makes one when none is set.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from stagemesh.cli import build_parser
from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.images.pipeline import generate_images, prepare_images
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.serve import HEALTH_CHECK_METHOD
from stagemesh.services.registry import build_stage
from stagemesh.shared import mesh_auth
from stagemesh.shared.proto.v1 import tokenizer_service_pb2 as pb
from stagemesh.shared.proto.v1 import tokenizer_service_pb2_grpc
from stagemesh.shared.server import open_channel
from stagemesh.shared.stage_runtime import start_stage, stop_stage

pytestmark = pytest.mark.timeout(60)
#: The async tests share the module's loop, where the module's tokenizer stage serves.
on_module_loop = pytest.mark.asyncio(loop_scope="module")

TOKEN = "mesh-token-for-tests-0123456789"
Metadata = tuple[tuple[str, str], ...]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tokenizer_address(tiny_model_dir: Path) -> AsyncIterator[str]:
    """A real tokenizer stage started with TOKEN configured (and still configured while the
    module's tests run, so `open_channel` carries it). One per module: a build takes seconds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(mesh_auth.TOKEN_ENV, TOKEN)
        bundle = build_stage("tokenizer", tiny_model_dir, None)
        server = await start_stage(bundle)
        yield f"127.0.0.1:{server.port}"
        await stop_stage(bundle, server, grace=0.5)


async def describe(channel: grpc.aio.Channel, metadata: Metadata = ()
                   ) -> pb.DescribeTokenizerResponse:
    stub = tokenizer_service_pb2_grpc.TokenizerServiceStub(channel)
    reply: pb.DescribeTokenizerResponse = await stub.DescribeTokenizer(
        pb.DescribeTokenizerRequest(), timeout=10, metadata=metadata)
    return reply


async def encode(channel: grpc.aio.Channel) -> list[pb.EncodePromptResponse]:
    stub = tokenizer_service_pb2_grpc.TokenizerServiceStub(channel)
    start = pb.EncodePromptRequest(start=pb.EncodePromptStart(request_id="r1", prompt="a cat"))
    return [reply async for reply in stub.EncodePrompt(iter([start]), timeout=20)]


@on_module_loop
async def test_the_mesh_channel_carries_the_token(tokenizer_address: str) -> None:
    async with open_channel(tokenizer_address) as channel:
        assert (await describe(channel)).max_prompt_chars > 0
        replies = await encode(channel)
    assert replies[-1].WhichOneof("event") == "result"


@on_module_loop
async def test_a_call_without_the_token_is_unauthenticated(tokenizer_address: str) -> None:
    stub_start = pb.EncodePromptRequest(start=pb.EncodePromptStart(request_id="r", prompt="x"))
    for metadata in [(), ((mesh_auth.METADATA_KEY, "wrong-token-0123456789"),),
                     ((mesh_auth.METADATA_KEY, TOKEN[:-1]),)]:
        async with grpc.aio.insecure_channel(tokenizer_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await describe(channel, metadata=metadata)
            stub = tokenizer_service_pb2_grpc.TokenizerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as stream:
                async for _ in stub.EncodePrompt(iter([stub_start]), timeout=10,
                                                 metadata=metadata):
                    pass
        assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata


async def oversized_calls(address: str, method: str, size: int) -> list[grpc.StatusCode]:
    """The statuses of a unary and a streamed call of one `size`-byte message to `method`,
    sent without the token, each on a new channel."""
    message = b"\x0a" + b"x" * size  # field 1, bytes: the start of any oversized request
    codes = []
    for streamed in (False, True):
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                if streamed:
                    call: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = (
                        channel.stream_stream(method))
                    async for _ in call(iter([message]), timeout=10):
                        pass
                else:
                    await channel.unary_unary(method)(message, timeout=10)
        codes.append(error.value.code())
    return codes


@on_module_loop
async def test_an_oversized_call_without_the_token_is_refused_not_internal(
    tokenizer_address: str,
) -> None:
    """A message larger than the stage's receive limit, sent without the token, is refused as
    unauthenticated or too large, never INTERNAL: a streamed call's refusal waits until the
    caller has written its message (a status that ends the call mid-write made grpc's client
    report INTERNAL, most of the time). The caller runs on its own loop, as a real one would."""
    methods = [f"/{pb.DESCRIPTOR.package}.TokenizerService/{name}"
               for name in ("EncodePrompt", "DescribeTokenizer")] + [
        "/stagemesh.v1.NoSuchService/Nothing"]
    for method in methods:
        for _ in range(3):  # the race it guards against is likely, not certain
            codes = await asyncio.to_thread(
                asyncio.run, oversized_calls(tokenizer_address, method, 8 << 20))
            assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED}, (method, codes)
    async with open_channel(tokenizer_address) as channel:  # it still serves the mesh
        assert (await describe(channel)).max_prompt_chars > 0


@on_module_loop
async def test_an_unknown_method_is_refused_the_same_way(tokenizer_address: str) -> None:
    """A caller without the token cannot tell which methods exist."""
    async with grpc.aio.insecure_channel(tokenizer_address) as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/stagemesh.v1.NoSuchService/Nothing")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(b"", timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


@on_module_loop
async def test_health_and_reflection_stay_open(tokenizer_address: str) -> None:
    """The kubelet's gRPC probe carries no metadata; reflection serves the public schema."""
    async with grpc.aio.insecure_channel(tokenizer_address) as channel:
        check: grpc.aio.UnaryUnaryMultiCallable[
            health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse] = channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        health = await check(health_pb2.HealthCheckRequest(service="stagemesh.v1.TokenizerService"),
                             timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    def services() -> list[str]:  # a blocking client, off the loop the stage serves on
        with grpc.insecure_channel(tokenizer_address) as channel:
            return list(ProtoReflectionDescriptorDatabase(channel).get_services())

    assert "stagemesh.v1.TokenizerService" in await asyncio.to_thread(services)


@on_module_loop
async def test_the_gateway_reaches_stages_that_require_the_token(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, make_image_recipe: Any
) -> None:
    monkeypatch.setenv(mesh_auth.TOKEN_ENV, TOKEN)
    bundles = {name: build_stage(name, tiny_model_dir, None)
               for name in ("tokenizer", "dit", "vae")}
    servers = {name: await start_stage(bundle) for name, bundle in bundles.items()}
    try:
        recipe = make_image_recipe({n: f"127.0.0.1:{s.port}" for n, s in servers.items()},
                                   tiny_model_dir)
        async with open_gateway({"tiny": recipe}) as core:
            job = await prepare_images(core, ImageRequest(prompt="a red circle",
                                                         num_inference_steps=2))
            images = await generate_images(core, job, RequestContext.create(None, 30))
        assert images[0].png.startswith(b"\x89PNG")
    finally:
        for name, bundle in bundles.items():
            await stop_stage(bundle, servers[name], grace=0.5)


def test_the_token_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert mesh_auth.mesh_token({}) is None  # no token: the check is off
    assert mesh_auth.mesh_token({mesh_auth.TOKEN_ENV: TOKEN}) == TOKEN
    assert mesh_auth.mesh_token({mesh_auth.TOKEN_FILE_ENV: str(token_file)}) == TOKEN
    for bad in ({mesh_auth.TOKEN_ENV: "short"}, {mesh_auth.TOKEN_ENV: "x" * 20 + " y"},
                {mesh_auth.TOKEN_FILE_ENV: str(tmp_path / "missing")}):
        with pytest.raises(mesh_auth.MeshTokenError):
            mesh_auth.mesh_token(bad)


def test_serve_makes_a_token_only_when_none_is_set() -> None:
    environ: dict[str, str] = {}
    made = mesh_auth.ensure_mesh_token(environ)
    assert environ[mesh_auth.TOKEN_ENV] == made and len(made) >= mesh_auth.MIN_TOKEN_CHARS
    assert mesh_auth.ensure_mesh_token(environ) == made
    assert mesh_auth.ensure_mesh_token({mesh_auth.TOKEN_ENV: TOKEN}) == TOKEN
    assert mesh_auth.ensure_mesh_token(dict(os.environ, **{mesh_auth.TOKEN_ENV: TOKEN})) == TOKEN


def test_a_stage_binds_loopback_unless_told_otherwise() -> None:
    args = build_parser().parse_args(["stage", "dit", "--model", "builtin:tiny", "--port", "1"])
    assert args.host == "127.0.0.1"
