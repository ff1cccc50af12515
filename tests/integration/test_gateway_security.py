"""The gateway as a hostile or careless client meets it: API keys, bounded cost before any
allocation, bad text as a 400 naming the field, the concurrency limit, refused parameters.

The whole gateway runs (`run_gateway`: uvicorn on a real port, the public gRPC port) over fake
stages: in-process grpc.aio servers that publish small limits through Describe and answer with
tiny canned tensors (no model). Each test is a regression test for a defect found by probing a
running mesh (issue 11).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.gateway.app import (
    MAX_GRPC_REQUEST_BYTES,
    GatewayConfig,
    open_gateway,
    run_gateway,
)
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.gateway.wire.auth import ApiKeys, owner_id
from stagemesh.gateway.wire.requests import MAX_BODY_BYTES
from stagemesh.serve import free_port
from stagemesh.shared.errors import abort_with, parse_rpc_error
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    dit_service_pb2_grpc,
    gateway_service_pb2,
    gateway_service_pb2_grpc,
)
from stagemesh.shared.tensors import array_to_proto
from tests.integration.fake_stages import (
    FakeCodec,
    FakeTalker,
    FakeTokenizer,
    FakeVae,
    cancel_watch,
    serve_fakes,
    start_message,
    stop_all,
)

pytestmark = pytest.mark.timeout(60)

KEY_A, KEY_B = "sk-alpha-0123456789", "sk-bravo-9876543210"
AUTH_A = {"authorization": f"Bearer {KEY_A}"}
AUTH_B = {"authorization": f"Bearer {KEY_B}"}
#: The id the stages know a request by, per key: qualified by its owner (gateway/mesh/calls.py).
AT_STAGE_A, AT_STAGE_B = f":{owner_id(KEY_A)}", f":{owner_id(KEY_B)}"


# -- fake stages ------------------------------------------------------------------------------


@dataclass
class Dit(dit_service_pb2_grpc.DitServiceServicer):
    """Publishes STEP mode only (request mode not allowed); each step takes `step_seconds`;
    `queue_full` answers every start with RESOURCE_EXHAUSTED, as a full engine does."""

    step_seconds: float = 0.0
    queue_full: bool = False
    running: set[str] = field(default_factory=set)

    async def DescribeDit(self, request: Any, context: Any) -> Any:
        return dit_service_pb2.DescribeDitResponse(
            stage=common_pb2.StageDescription(stage="dit", max_pending=8), size_multiple=8,
            max_side=64, max_pixels=64 * 64, max_steps=100, max_true_cfg_scale=5.0,
            max_images_per_request=2, execution_modes=[common_pb2.EXECUTION_MODE_STEP])

    async def Denoise(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = await start_message(requests)
        if self.queue_full:
            await abort_with(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full",
                             reason="QUEUE_FULL")
        self.running.add(start.request_id)
        try:
            async with cancel_watch(requests) as cancelled:
                yield dit_service_pb2.DenoiseResponse(queued=common_pb2.Queued(position=0))
                for step in range(1, start.num_inference_steps + 1):
                    await asyncio.sleep(self.step_seconds)
                    if cancelled.is_set():
                        yield dit_service_pb2.DenoiseResponse(
                            aborted=common_pb2.Aborted(step_index=step))
                        return
                    yield dit_service_pb2.DenoiseResponse(progress=common_pb2.Progress(
                        step_index=step, total_steps=start.num_inference_steps))
                yield dit_service_pb2.DenoiseResponse(result=dit_service_pb2.DenoiseResult(
                    latents=array_to_proto(np.zeros((1, 1), np.float32)), height=start.height,
                    width=start.width, steps=start.num_inference_steps))
        finally:
            self.running.discard(start.request_id)


# -- the gateway over them ------------------------------------------------------------------


@dataclass
class Gateway:
    recipes: dict[str, Recipe]
    dit: Dit
    http: httpx.AsyncClient  # real HTTP to uvicorn, no key
    base_url: str
    http_port: int
    rpc: gateway_service_pb2_grpc.GatewayServiceAsyncStub
    channel: grpc.aio.Channel

    def client(self, headers: dict[str, str]) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=20)


def _recipes(addresses: dict[str, str]) -> dict[str, Recipe]:
    def endpoints(*names: str) -> dict[str, StageEndpoint]:
        return {name: StageEndpoint(name, addresses[name]) for name in names}

    return {"img": Recipe("img", Task.TEXT_TO_IMAGE, "m", endpoints("tokenizer", "dit", "vae"),
                          ImageDefaults(width=16, height=16, num_inference_steps=2)),
            "tts": Recipe("tts", Task.TEXT_TO_SPEECH, "m", endpoints("talker", "codec"))}


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, max_concurrent: int | None = None) -> AsyncIterator[Gateway]:
    """Fake stages, then the whole gateway (keys A and B from a keys file) on free ports."""
    dit = Dit()
    servers, addresses = await serve_fakes({
        "tokenizer": FakeTokenizer(max_pending=8), "dit": dit,
        "vae": FakeVae(size_multiple=8, max_side=64, max_pending=8, level=9),
        "talker": FakeTalker(max_pending=8), "codec": FakeCodec(max_pending=8)})
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"# the team's keys\n{KEY_A}\n\n{KEY_B}  # bravo\n")
    config = GatewayConfig(http_port=free_port(), grpc_port=free_port(),
                           api_keys_file=keys_file, max_concurrent_requests=max_concurrent)
    ready, stop = asyncio.Event(), asyncio.Event()
    recipes = _recipes(addresses)
    task = asyncio.create_task(run_gateway(recipes, config, ready, stop))
    try:
        await asyncio.wait_for(ready.wait(), 20)
        base_url = f"http://127.0.0.1:{config.http_port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=20) as http, \
                grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
            yield Gateway(recipes, dit, http, base_url, config.http_port,
                          gateway_service_pb2_grpc.GatewayServiceStub(channel), channel)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await stop_all(servers)


@pytest.fixture
async def gw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.delenv("STAGEMESH_API_KEYS", raising=False)
    async with gateway(tmp_path) as running:
        yield running


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


IMAGE = {"prompt": "a cat", "size": "16x16", "num_inference_steps": 2}
NATIVE_IMAGE = {"prompt": "a cat", "width": 16, "height": 16, "num_inference_steps": 2}


# -- authentication ---------------------------------------------------------------------------


async def test_rest_needs_one_of_the_keys_and_leaves_health_and_metrics_open(gw: Gateway) -> None:
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": KEY_A}):
        refused = await gw.http.post("/v1/images/generations", json=IMAGE, headers=headers)
        assert refused.status_code == 401, headers
        assert refused.headers["www-authenticate"] == "Bearer"
        assert error_of(refused)["code"] == "invalid_api_key"
    assert (await gw.http.get("/v1/recipes")).status_code == 401  # native routes too
    assert (await gw.http.get("/health")).status_code != 401  # 503: the fakes have no health
    assert (await gw.http.get("/metrics")).status_code == 200
    for key in (KEY_A, KEY_B):
        images = openai.AsyncOpenAI(api_key=key, base_url=f"{gw.base_url}/v1").images
        answer = await images.generate(prompt="a cat", size="16x16")
        assert answer.data and answer.data[0].b64_json
    wrong = openai.AsyncOpenAI(api_key="sk-nope", base_url=f"{gw.base_url}/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.images.generate(prompt="a cat", size="16x16")


async def test_grpc_needs_one_of_the_keys_and_leaves_health_open(gw: Gateway) -> None:
    request = gateway_service_pb2.ListRecipesRequest()
    for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await gw.rpc.ListRecipes(request, metadata=metadata)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as stream_refused:
        async for _ in gw.rpc.GenerateImage(gateway_service_pb2.GenerateImageRequest(prompt="x")):
            pass
    assert stream_refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    recipes = await gw.rpc.ListRecipes(request, metadata=tuple(AUTH_B.items()))
    assert {r.name for r in recipes.recipes} == {"img", "tts"}
    health = health_pb2_grpc.HealthStub(gw.channel)
    # The stub package's HealthStub declares no methods (see serve.HEALTH_CHECK_METHOD).
    answer = await health.Check(health_pb2.HealthCheckRequest())  # type: ignore[attr-defined]
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_request_can_be_cancelled_only_with_the_key_that_started_it(
    gw: Gateway, wait_until: Any,
) -> None:
    gw.dit.step_seconds = 0.2
    async with gw.client(AUTH_A) as alpha, gw.client(AUTH_B) as bravo:
        running = asyncio.create_task(alpha.post(
            "/v1/images/generations", json={**IMAGE, "num_inference_steps": 50},
            headers={"x-request-id": "mine-1"}))
        await wait_until(lambda: "mine-1" + AT_STAGE_A in gw.dit.running,
                         what="the DiT running mine-1")
        stranger = await bravo.post("/v1/requests/mine-1/cancel")
        assert stranger.status_code == 404 and error_of(stranger)["param"] == "request_id"
        assert "mine-1" + AT_STAGE_A in gw.dit.running
        owner = await alpha.post("/v1/requests/mine-1/cancel")
        assert owner.status_code == 200, owner.text
        assert owner.json()["state"] == "REQUEST_STATE_ABORTED"
        assert (await running).status_code == 499  # the cancelled request's own answer


async def test_two_keys_run_requests_of_the_same_id_side_by_side(
    gw: Gateway, wait_until: Any,
) -> None:
    """An id belongs to the key that started the request: another key may use it at the same
    time (both run, each stage request apart), and its cancel stops only its own request.
    The same key cannot run two requests of one id."""
    gw.dit.step_seconds = 0.1
    same = {"x-request-id": "same"}
    a_ids = {f"same{AT_STAGE_A}.0", f"same{AT_STAGE_A}.1"}  # A's two images: two DiT requests
    async with gw.client(AUTH_A) as alpha, gw.client(AUTH_B) as bravo:
        b_running = asyncio.create_task(bravo.post(
            "/v1/images/generations", json={**IMAGE, "num_inference_steps": 100}, headers=same))
        a_running = asyncio.create_task(alpha.post(
            "/v1/images/generations", json={**IMAGE, "num_inference_steps": 30, "n": 2},
            headers=same))
        await wait_until(lambda: {f"same{AT_STAGE_B}", *a_ids} <= gw.dit.running,
                         what="the DiT running both keys' requests `same`")
        again = await alpha.post("/v1/images/generations", json=IMAGE, headers=same)
        assert again.status_code == 409, again.text
        assert error_of(again)["param"] == "request_id"
        cancelled = await bravo.post("/v1/requests/same/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["state"] == "REQUEST_STATE_ABORTED"
        assert cancelled.json()["request_id"] == "same"  # the client's id, not the stages'
        b_answer = await b_running
        assert b_answer.status_code == 499
        await wait_until(lambda: f"same{AT_STAGE_B}" not in gw.dit.running,
                         what="B's request gone from the DiT")
        assert a_ids <= gw.dit.running  # B's cancel left A's request running
        a_answer = await a_running
        assert a_answer.status_code == 200, a_answer.text
        assert a_answer.headers["x-request-id"] == "same"
        assert len(a_answer.json()["data"]) == 2


# -- bounded cost before allocation ---------------------------------------------------------


def _raw_http(port: int, head: bytes, body_part: bytes) -> bytes:
    """Send a request head and part of its body on a raw socket; the answer, up to the
    server closing the connection (or 64 KiB)."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body_part)
        while len(answer) < 65536 and (data := sock.recv(4096)):
            answer += data
    return answer


async def test_a_body_declared_over_the_cap_is_refused_before_it_is_read(gw: Gateway) -> None:
    head = (f"POST /v1/images/generations HTTP/1.1\r\nhost: gw\r\n"
            f"authorization: Bearer {KEY_A}\r\ncontent-type: application/json\r\n"
            f"content-length: {400 * 1024 * 1024}\r\n\r\n").encode()
    started = time.monotonic()
    answer = await asyncio.to_thread(_raw_http, gw.http_port, head, b'{"prompt": "')
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.monotonic() - started < 5  # answered without waiting for 400 MB


async def test_a_streamed_body_is_refused_as_it_passes_the_cap_and_not_read_further(
    gw: Gateway,
) -> None:
    chunk = b" " * (1024 * 1024)
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(400):  # 400 MB, never all read
            sent += 1
            yield chunk

    # In-process ASGI: the app pulls each chunk itself, so what it did not pull was not read.
    async with open_gateway(gw.recipes) as core:
        app = build_rest_app(core, ApiKeys.of([KEY_A]))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            response = await client.post("/v1/images/generations", content=body(),
                                         headers=AUTH_A)
    assert response.status_code == 413 and error_of(response)["param"] == "body"
    assert sent <= MAX_BODY_BYTES // len(chunk) + 2


async def test_a_large_odd_data_url_is_refused_fast_naming_ref_audio(gw: Gateway) -> None:
    payload = "A" * (15 * 1024 * 1024)
    odd = ["data:audio/wav" + ";a=b" * 5000 + ";base64," + payload,  # header past its cap
           "data:audio/wav;x=" + "=" * 200 + "+base64," + payload,  # no ;base64 marker
           "data:audio/wav;base64," + payload[:-1] + "!"]  # base64 broken at the very end
    async with gw.client(AUTH_A) as client:
        for ref_audio in odd:
            started = time.monotonic()
            response = await client.post("/v1/audio/speech", json={
                "input": "Hi", "task_type": "Base", "ref_audio": ref_audio})
            assert response.status_code == 400 and error_of(response)["param"] == "ref_audio"
            assert time.monotonic() - started < 3  # was 4 s with the whole gateway stalled
            health = await client.get("/metrics")  # the loop still answers in between
            assert health.status_code == 200


NOT_JSON_TEXT = [b'{"prompt": "caf\xe9"}',  # latin-1, not UTF-8
                 '{"prompt": "x"}'.encode("utf-16"),  # JSON, but not UTF-8
                 b'{"seed": ' + b"9" * 5000 + b"}",  # past Python's int-parsing limit
                 b'{"seed": NaN}', b'{"true_cfg_scale": 1e999}', b"[" * 100_000]


@pytest.mark.parametrize("path", ["/v1/images/generations", "/v1/audio/speech",
                                  "/v1/images:generate", "/v1/speech:synthesize"])
async def test_a_body_that_is_not_utf8_json_is_a_400_naming_the_body(gw: Gateway,
                                                                     path: str) -> None:
    async with gw.client(AUTH_A) as client:
        for body in NOT_JSON_TEXT:
            response = await client.post(path, content=body,
                                         headers={"content-type": "application/json"})
            assert response.status_code == 400 and error_of(response)["param"] == "body", body


@pytest.mark.parametrize(("path", "body", "field_name"), [
    ("/v1/images/generations", '{"prompt": "a \\ud800 cat"}', "prompt"),
    ("/v1/images:generate", '{"prompt": "a \\udfff cat"}', "prompt"),
    ("/v1/audio/speech", '{"input": "hi", "voice": ["x", {"y": "\\ud83d"}]}', "voice"),
])
async def test_a_lone_surrogate_is_a_400_naming_its_field(gw: Gateway, path: str, body: str,
                                                          field_name: str) -> None:
    async with gw.client(AUTH_A) as client:
        response = await client.post(path, content=body.encode(),
                                     headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == field_name


BAD_IDS = ["two\nlines", "caf\u00e9", "a b", "x" * 129]


@pytest.mark.parametrize("bad_id", BAD_IDS)
async def test_a_bad_request_id_is_a_400_naming_it_on_every_route(gw: Gateway,
                                                                  bad_id: str) -> None:
    async with gw.client(AUTH_A) as client:
        native = await client.post("/v1/images:generate",
                                   json={**NATIVE_IMAGE, "request_id": bad_id})
        assert native.status_code == 400 and error_of(native)["param"] == "request_id"
        cancel = await client.post(f"/v1/requests/{urllib.parse.quote(bad_id)}/cancel")
        assert cancel.status_code == 400 and error_of(cancel)["param"] == "request_id"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in gw.rpc.GenerateImage(gateway_service_pb2.GenerateImageRequest(
                prompt="x", request_id=bad_id), metadata=tuple(AUTH_A.items())):
            pass
    error = parse_rpc_error(refused.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and error.field_name == "request_id"
    assert gw.dit.running == set()


@pytest.mark.parametrize("header", [b"two\x01lines", b"caf\xc3\xa9", b"x" * 129])
async def test_a_bad_x_request_id_header_is_a_400_not_replaced(gw: Gateway,
                                                               header: bytes) -> None:
    head = (b"POST /v1/images/generations HTTP/1.1\r\nhost: gw\r\n"
            + f"authorization: Bearer {KEY_A}\r\n".encode()
            + b"x-request-id: " + header + b"\r\ncontent-type: application/json\r\n"
            + b"content-length: 2\r\nconnection: close\r\n\r\n")
    answer = await asyncio.to_thread(_raw_http, gw.http_port, head, b"{}")
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b'"param":"x-request-id"' in answer


async def test_over_the_concurrency_limit_a_429_says_when_to_retry(tmp_path: Path,
                                                                  wait_until: Any) -> None:
    async with gateway(tmp_path, max_concurrent=1) as gw, gw.client(AUTH_A) as client:
        gw.dit.step_seconds = 0.05
        first = asyncio.create_task(client.post("/v1/images/generations", json={
            **IMAGE, "num_inference_steps": 20}))
        await wait_until(lambda: bool(gw.dit.running), what="the first request running")
        refused = await client.post("/v1/images/generations", json=IMAGE)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            async for _ in gw.rpc.GenerateImage(gateway_service_pb2.GenerateImageRequest(
                    prompt="x"), metadata=tuple(AUTH_A.items())):
                pass
        assert busy.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(busy.value.trailing_metadata() or ())["retry-after"]) >= 1
        assert (await first).status_code == 200
        gw.dit.step_seconds = 0.0
        assert (await client.post("/v1/images/generations", json=IMAGE)).status_code == 200


async def test_a_stage_queue_full_429_says_when_to_retry(gw: Gateway) -> None:
    gw.dit.queue_full = True
    async with gw.client(AUTH_A) as client:
        response = await client.post("/v1/images/generations", json=IMAGE)
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1


@pytest.mark.parametrize(("fields", "field_name"), [
    ({"temperature": 1e-40}, "temperature"),  # inf/NaN logits: refused before the talker
    ({"temperature": 0.001}, "temperature"),
])
async def test_sampling_that_cannot_give_finite_logits_is_refused(
    gw: Gateway, fields: dict[str, Any], field_name: str,
) -> None:
    async with gw.client(AUTH_A) as client:
        response = await client.post("/v1/audio/speech", json={"input": "Hi", **fields})
    assert response.status_code == 400 and error_of(response)["param"] == field_name
    assert "greedy" in error_of(response)["message"]


async def test_request_mode_is_refused_unless_the_dit_offers_it(gw: Gateway) -> None:
    async with gw.client(AUTH_A) as client:
        response = await client.post("/v1/images/generations",
                                     json={**IMAGE, "execution_mode": "request"})
        assert response.status_code == 400
        assert error_of(response)["param"] == "execution_mode"
        native = await client.post("/v1/images:generate",
                                   json={**NATIVE_IMAGE,
                                         "execution_mode": "EXECUTION_MODE_REQUEST"})
        assert native.status_code == 400 and error_of(native)["param"] == "execution_mode"
    assert gw.dit.running == set()


async def test_the_public_grpc_port_refuses_a_message_over_the_largest_legal_request(
    gw: Gateway,
) -> None:
    huge = gateway_service_pb2.SynthesizeSpeechRequest(
        input="Hi", ref_audio=b"\0" * (MAX_GRPC_REQUEST_BYTES + 1))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in gw.rpc.SynthesizeSpeech(huge, metadata=tuple(AUTH_A.items())):
            pass
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert MAX_GRPC_REQUEST_BYTES < 64 * 1024 * 1024


@pytest.mark.parametrize(("raw", "field_name"), [
    (b"\x12\x02\xff\xfe", "prompt"),  # field 2 (prompt): bad UTF-8
    (b"\x12\x01x\x52\x03a\xc3(", "request_id"),  # field 10 (request_id): bad UTF-8
    (b"\x12\x09truncated"[:-2], "request"),  # says 9 bytes, holds fewer
])
async def test_a_grpc_message_that_does_not_decode_is_invalid_argument(
    gw: Gateway, raw: bytes, field_name: str,
) -> None:
    call = gw.channel.unary_stream("/stagemesh.v1.GatewayService/GenerateImage",
                                   request_serializer=lambda message: message,
                                   response_deserializer=lambda message: message)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in call(raw, metadata=tuple(AUTH_A.items())):
            pass
    error = parse_rpc_error(refused.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and error.field_name == field_name
