"""End to end: `stagemesh serve` in a subprocess, driven by the openai SDK, httpx and gRPC."""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import openai
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from PIL import Image

from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0)


def png_size(data: bytes) -> tuple[int, int]:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image.size


def test_openai_sdk_gets_a_png_of_the_requested_size(client: openai.OpenAI) -> None:
    result = client.images.generate(prompt="a red circle on the left", size="64x32",
                                    response_format="b64_json", extra_body={"seed": 1})
    assert len(result.data) == 1
    assert png_size(base64.b64decode(result.data[0].b64_json)) == (64, 32)


def test_the_same_seed_gives_identical_bytes(client: openai.OpenAI) -> None:
    def generate(seed: int) -> bytes:
        result = client.images.generate(prompt="a blue square", size="64x64",
                                        extra_body={"seed": seed, "num_inference_steps": 3})
        return base64.b64decode(result.data[0].b64_json)

    first = generate(11)
    assert generate(11) == first
    assert generate(12) != first


def test_chat_completions_returns_the_image_as_a_data_url(served) -> None:
    response = httpx.post(f"{served.http_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "A flower"}],
        "extra_body": {"height": 32, "width": 48, "num_inference_steps": 3,
                       "true_cfg_scale": 4.0, "seed": 42}})
    assert response.status_code == 200
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert png_size(base64.b64decode(url.split(",", 1)[1])) == (48, 32)


def test_the_openai_sdk_chat_path_works_too(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "A flower"}],
        extra_body={"size": "32x32", "num_inference_steps": 2, "seed": 3})
    content = completion.choices[0].message.content
    assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")


def test_grpc_gateway_streams_progress_then_the_image(served) -> None:
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        events = list(stub.GenerateImage(pb.GenerateImageRequest(
            prompt="a green triangle", width=32, height=64, num_inference_steps=4, seed=5,
            request_id="grpc-e2e-1"), timeout=60))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-1] == "result" and all(e.request_id == "grpc-e2e-1" for e in events)
    steps = [e.progress.step_index for e in events if e.stage == "dit" and
             e.WhichOneof("event") == "progress"]
    assert steps == [1, 2, 3, 4]
    image = events[-1].result.images[0]
    assert png_size(image.png) == (32, 64) and image.seed == 5


def test_grpc_bad_input_is_invalid_argument_naming_the_field(served) -> None:
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failure:
            list(stub.GenerateImage(pb.GenerateImageRequest(prompt="x", num_inference_steps=999),
                                    timeout=30))
    error = parse_rpc_error(failure.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.field_name == "num_inference_steps"


def test_reflection_lists_the_gateway_and_each_stage_service(served) -> None:
    with grpc.insecure_channel(served.grpc_target) as channel:
        assert "stagemesh.v1.GatewayService" in ProtoReflectionDescriptorDatabase(
            channel).get_services()
    expected = {"tokenizer": "stagemesh.v1.TokenizerService", "dit": "stagemesh.v1.DitService",
                "vae": "stagemesh.v1.VaeService", "talker": "stagemesh.v1.TalkerService",
                "codec": "stagemesh.v1.CodecService", "thinker": "stagemesh.v1.ThinkerService",
                "transcriber": "stagemesh.v1.TranscriberService"}
    for name, stage in served.stages().items():
        assert stage["health"] == "SERVING"
        with grpc.insecure_channel(stage["address"]) as channel:
            assert expected[name] in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_stages_report_where_they_compute(served) -> None:
    """GET /v1/stages carries each stage's device and dtype, as its Describe published them:
    on this CPU-only machine every stage computes on the CPU, in float32 except where the
    stage measured bfloat16 faster (the VAE, on a CPU with bfloat16 instructions)."""
    stages = served.stages()
    assert set(stages) == {"tokenizer", "dit", "vae", "talker", "codec", "thinker", "transcriber"}
    for name, stage in stages.items():
        assert stage["device"] == "cpu", name
        expected = {"float32", "bfloat16"} if name == "vae" else {"float32"}
        assert stage["dtype"] in expected, (name, stage["dtype"])


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "size": "68x64"}, "size"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 100_000}, "num_inference_steps"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "model": "no-such-model"}, "model"),
    ({"prompt": "x", "n": 99}, "n"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
])
def test_bad_input_is_a_400_naming_the_field(served, body: dict, param: str) -> None:
    response = httpx.post(f"{served.http_url}/v1/images/generations", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error",
                                                              "invalid_argument")
    assert response.headers["x-request-id"]


def test_the_openai_sdk_raises_bad_request_on_bad_size(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="multiple of 8"):
        client.images.generate(prompt="x", size="7x7")


def test_every_response_carries_a_request_id_and_echoes_the_clients(served) -> None:
    assert httpx.get(f"{served.http_url}/v1/models").headers["x-request-id"]
    response = httpx.get(f"{served.http_url}/v1/models", headers={"x-request-id": "mine-42"})
    assert response.headers["x-request-id"] == "mine-42"
    models = response.json()
    assert models["object"] == "list"
    assert {m["id"] for m in models["data"]} >= {"tiny-shapes", "csm-tiny"}


def test_native_routes_come_from_the_proto_annotations(served) -> None:
    response = httpx.post(f"{served.http_url}/v1/images:generate", timeout=60, json={
        "prompt": "a red circle", "width": 32, "height": 32, "num_inference_steps": 2})
    assert response.status_code == 200
    lines = [line for line in response.text.splitlines() if line]
    assert '"result"' in lines[-1]
    unknown = httpx.post(f"{served.http_url}/v1/images:generate", json={"prompt": "x",
                                                                         "colour": "red"})
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"]
    # one error body everywhere: OpenAI's shape, `param` naming the field
    assert unknown.json()["error"]["param"] == "colour"
    assert unknown.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{served.http_url}/v1/requests/nobody/cancel", timeout=10)
    assert missing.status_code == 404 and missing.json() == {"error": {
        "message": "no running request with id 'nobody'", "type": "invalid_request_error",
        "param": "request_id", "code": "not_found"}}
    recipes = httpx.get(f"{served.http_url}/v1/recipes").json()["recipes"]
    assert recipes[0]["stages"] == ["tokenizer", "dit", "vae"]


def test_the_gateway_serves_its_own_metrics_by_route_template(served) -> None:
    httpx.post(f"{served.http_url}/v1/requests/some-id/cancel")
    httpx.post(f"{served.http_url}/v1/audio/speech", timeout=60, json={
        "model": "csm-tiny", "input": "Hi", "voice": "vivian", "stream": True,
        "max_new_tokens": 4})
    text = httpx.get(f"{served.http_url}/metrics").text
    assert 'route="/v1/requests/{request_id}/cancel",status="404"' in text  # no raw ids
    assert 'stagemesh_gateway_ttfp_seconds_count{recipe="csm-tiny"}' in text
