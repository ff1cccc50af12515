"""Native REST routes: derived from GatewayService's google.api.http annotations, strict JSON,
path parameters, NDJSON streams, and the one error body (no gRPC server involved)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import httpx
import pytest
from starlette.applications import Starlette

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError, InvalidRequest
from stagemesh.gateway.grpc.native import NativeApi, image_request
from stagemesh.gateway.grpc.transcoding import (
    HttpBinding,
    annotated_routes,
    http_bindings,
    parse_error_field,
    to_json,
)
from stagemesh.gateway.http.app import EXCEPTION_HANDLERS, RequestIdMiddleware
from stagemesh.gateway.mesh.stages import Mesh, StageCatalog, publish_into
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb

RECIPE = Recipe(name="tiny", task=Task.TEXT_TO_IMAGE, model="m", stages={
    s: StageEndpoint(s, f"127.0.0.1:{i + 1}") for i, s in enumerate(("tokenizer", "dit", "vae"))})


class ScriptedApi(NativeApi):
    """GenerateImage answers from a script: a progress event, then an error or the result."""

    def __init__(self, fail_at: int | None = None) -> None:
        mesh = Mesh({RECIPE.name: RECIPE})  # never started: no channel is ever used here
        super().__init__(GatewayCore(mesh, StageCatalog(mesh)))
        self.fail_at = fail_at
        self.seen: list[tuple[pb.GenerateImageRequest, RequestContext]] = []

    async def GenerateImage(
        self, request: pb.GenerateImageRequest, context: RequestContext,
    ) -> AsyncGenerator[pb.GenerateImageResponse, None]:
        self.seen.append((request, context))
        context = context.for_request(request.request_id)
        events = [pb.GenerateImageResponse(request_id=context.request_id, stage="dit",
                                           progress=common_pb2.Progress(step_index=1)),
                  pb.GenerateImageResponse(request_id=context.request_id, result=pb.GeneratedImages(
                      images=[pb.GeneratedImage(png=b"png", seed=request.seed)]))]
        for index, event in enumerate(events):
            if index == self.fail_at:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "dit stage is unavailable",
                                   reason="STAGE_UNAVAILABLE")
            yield event


@pytest.fixture
def api() -> ScriptedApi:
    return ScriptedApi()


async def client_for(api: NativeApi) -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(routes=annotated_routes(api), exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(RequestIdMiddleware)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as client:
        yield client


@pytest.fixture
async def client(api: ScriptedApi) -> AsyncIterator[httpx.AsyncClient]:
    async for client in client_for(api):
        yield client


def test_routes_are_derived_from_the_annotations() -> None:
    assert http_bindings() == [
        HttpBinding("GenerateImage", "POST", "/v1/images:generate", "*"),
        HttpBinding("EditImage", "POST", "/v1/images:edit", "*"),
        HttpBinding("CreateVideo", "POST", "/v1/videoJobs", "*"),
        HttpBinding("GetVideo", "GET", "/v1/videoJobs/{id}", ""),
        HttpBinding("ListVideos", "GET", "/v1/videoJobs", ""),
        HttpBinding("DeleteVideo", "DELETE", "/v1/videoJobs/{id}", ""),
        HttpBinding("WatchVideo", "GET", "/v1/videoJobs/{id}:watch", ""),
        HttpBinding("DownloadVideo", "GET", "/v1/videoJobs/{id}:download", ""),
        HttpBinding("SynthesizeSpeech", "POST", "/v1/speech:synthesize", "*"),
        HttpBinding("TranscribeAudio", "POST", "/v1/audio:transcribe", "*"),
        HttpBinding("Chat", "POST", "/v1/chat:complete", "*"),
        HttpBinding("CancelRequest", "POST", "/v1/requests/{request_id}/cancel", ""),
        HttpBinding("ListStages", "GET", "/v1/stages", ""),
        HttpBinding("ListRecipes", "GET", "/v1/recipes", ""),
    ]
    routes = annotated_routes(ScriptedApi())
    assert sorted((r.path, tuple(sorted(r.methods or ()))) for r in routes) == sorted(
        (b.path, ("GET", "HEAD") if b.verb == "GET" else (b.verb,)) for b in http_bindings())


def test_custom_methods_are_routed_before_the_plain_resource_path() -> None:
    """`GET /v1/videoJobs/x:watch` must reach WatchVideo, not GetVideo with id `x:watch`."""
    paths = [r.path for r in annotated_routes(ScriptedApi())]
    assert paths.index("/v1/videoJobs/{id}:watch") < paths.index("/v1/videoJobs/{id}")
    assert paths.index("/v1/videoJobs/{id}:download") < paths.index("/v1/videoJobs/{id}")



async def test_a_unary_rpc_answers_its_message_as_json(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/recipes")
    assert response.status_code == 200
    assert response.json() == {"recipes": [{"name": "tiny", "task": "text-to-image",
                                            "stages": ["tokenizer", "dit", "vae"]}]}


async def test_path_parameters_fill_the_message(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/requests/job-7/cancel")
    assert response.status_code == 404
    assert response.json() == {"error": {
        "message": "no running request with id 'job-7'", "type": "invalid_request_error",
        "param": "request_id", "code": "not_found"}}


async def test_a_stream_answers_ndjson_one_message_a_line(
    api: ScriptedApi, client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/images:generate", json={"prompt": "x", "seed": "5"},
                                 headers={"x-request-id": "mine-1"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert [line["request_id"] for line in lines] == ["mine-1", "mine-1"]
    assert lines[0]["progress"]["step_index"] == 1 and lines[0]["stage"] == "dit"
    assert lines[1]["result"]["images"][0]["seed"] == "5"  # int64 is a JSON string
    request, context = api.seen[0]
    assert request.prompt == "x" and request.seed == 5 and context.request_id == "mine-1"


async def test_the_message_request_id_wins_over_the_header(
    api: ScriptedApi, client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/images:generate", json={"prompt": "x",
                                                               "request_id": "body-id"})
    assert {json.loads(line)["request_id"] for line in response.text.splitlines()} == {"body-id"}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": "x", "n": "many"}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "execution_mode": "FAST"}, "execution_mode"),
    ({"prompt": "x", "true_cfg_scale": "high"}, "true_cfg_scale"),
    ({"prompt": 5}, "prompt"),
])
async def test_strict_json_refuses_unknown_and_mistyped_fields_naming_them(
    client: httpx.AsyncClient, body: dict[str, object], param: str,
) -> None:
    response = await client.post("/v1/images:generate", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_argument")


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"])
async def test_a_body_that_is_not_a_json_object_names_the_body(
    client: httpx.AsyncClient, content: bytes,
) -> None:
    response = await client.post("/v1/images:generate", content=content)
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"


async def test_query_parameters_of_a_get_are_strict_too(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/recipes", params={"colour": "red"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "colour"


async def test_an_error_before_the_first_message_keeps_its_http_status() -> None:
    async for client in client_for(ScriptedApi(fail_at=0)):
        response = await client.post("/v1/images:generate", json={"prompt": "x"})
    assert response.status_code == 503
    assert response.json() == {"error": {"message": "dit stage is unavailable",
                                         "type": "service_unavailable", "param": None,
                                         "code": "stage_unavailable"}}


async def test_an_error_after_the_first_message_is_the_last_line() -> None:
    async for client in client_for(ScriptedApi(fail_at=1)):
        response = await client.post("/v1/images:generate", json={"prompt": "x"})
    assert response.status_code == 200
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert "progress" in lines[0]
    assert lines[-1] == {"error": {"message": "dit stage is unavailable",
                                   "type": "service_unavailable", "param": None,
                                   "code": "stage_unavailable"}}


@pytest.mark.parametrize(("message", "field"), [
    ('Message type "stagemesh.v1.X" has no field named "colour" at "X".', "colour"),
    ('Message type "stagemesh.v1.X" has no field named "" at "X".', ""),
    ("Failed to parse n field: invalid literal for int() with base 10: 'a'.", "n"),
    ("Couldn't parse float: a at GenerateImageRequest.true_cfg_scale", "true_cfg_scale"),
    ("something else", None),
])
def test_parse_errors_name_their_field(message: str, field: str | None) -> None:
    assert parse_error_field(message) == field


def test_invalid_request_without_a_field_has_a_null_param() -> None:
    assert InvalidRequest(None, "bad").body()["error"]["param"] is None


def test_a_native_image_request_carries_its_priority() -> None:
    assert image_request(pb.GenerateImageRequest(prompt="x", priority=-2)).priority == -2
    assert image_request(pb.GenerateImageRequest(prompt="x")).priority == 0  # the default


def test_a_stage_row_shows_the_quantization_and_compile_its_describe_publishes() -> None:
    """GET /v1/stages (ListStages as JSON): the DiT's quantization and compile, the tokenizer's
    quantization, as their Describe answers say; empty for a stage without the options."""
    where = common_pb2.StageDescription(device="cpu", dtype="float32")
    answers = {
        "dit": dit_service_pb2.DescribeDitResponse(stage=where, quantization="int8",
                                                   compile="blocks"),
        "tokenizer": tokenizer_service_pb2.DescribeTokenizerResponse(stage=where,
                                                                     quantization="int8"),
        "vae": vae_service_pb2.DescribeVaeResponse(stage=where),
    }
    rows = {}
    for name, answer in answers.items():
        info = pb.StageInfo(name=name)
        publish_into(info, answer)
        rows[name] = to_json(info)
    assert {name: (row["quantization"], row["compile"], row["device"])
            for name, row in rows.items()} == {"dit": ("int8", "blocks", "cpu"),
                                               "tokenizer": ("int8", "", "cpu"),
                                               "vae": ("", "", "cpu")}


def test_a_stage_row_shows_the_parallel_group_its_describe_publishes() -> None:
    """GET /v1/stages: a DiT group's degrees and devices, as its Describe publishes them;
    zero and empty for another stage."""
    where = common_pb2.StageDescription(device="cuda:0", dtype="bfloat16")
    group = dit_service_pb2.DescribeDitResponse(
        stage=where, parallel_cfg=2, parallel_ulysses=2,
        group_devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    rows = []
    for answer in (group, vae_service_pb2.DescribeVaeResponse(stage=where)):
        info = pb.StageInfo(name="x")
        publish_into(info, answer)
        rows.append(to_json(info))
    assert [(row["parallel_cfg"], row["parallel_ulysses"], row["group_devices"])
            for row in rows] == [(2, 2, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]), (0, 0, [])]
