"""Fuzz the gateway through the OpenAPI document it serves: schemathesis builds requests for
every route in GET /openapi.json (valid ones, and ones that break the schema) and sends them
over real HTTP to a real gateway over real tiny stages (image: tokenizer, DiT, VAE; speech:
talker, codec).

The rules every answer must keep: never a 5xx, and every 4xx carries the one error body, a 400
naming the field at fault (`param`). The stages run with tight limits so that a valid request
costs milliseconds, and the examples per route are bounded, so the suite stays well under 90 s
on two cores.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.core.result import Ok

from stagemesh.gateway.app import GatewayConfig, run_gateway
from stagemesh.gateway.grpc.transcoding import http_bindings
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.models.speech import ensure_speech_model
from stagemesh.serve import free_port

pytestmark = pytest.mark.timeout(240)

#: Tight stage limits: every valid request is a few milliseconds of tiny-model work.
STAGE_OPTIONS: dict[str, dict[str, object]] = {
    "tokenizer": {"max_prompt_chars": 200},
    "dit": {"max_steps": 2, "max_side": 64, "max_pixels": 64 * 64,
            "max_images_per_request": 2},
    "vae": {},
    "talker": {"max_new_frames": 4, "max_input_chars": 40, "max_running": 4},
    "codec": {"max_running": 4},
}
#: Examples per route and generation mode (12 routes: about 300 requests in all).
MAX_EXAMPLES = 12
#: Seconds one request may take (a valid one takes well under one).
REQUEST_TIMEOUT_S = 30.0


class Mesh:
    """The five tiny stages and a gateway over them, on a loop in their own thread (the test
    drives them over HTTP from the test's thread, as any client would)."""

    def __init__(self, image_model: Path, speech_model: Path, make_stages_thread: Any) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.models = {"tokenizer": image_model, "dit": image_model, "vae": image_model,
                       "talker": speech_model, "codec": speech_model}
        self.stages = make_stages_thread(
            {name: (model, STAGE_OPTIONS[name]) for name, model in self.models.items()},
            then=self._gateway)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def _gateway(self, address: dict[str, str], ready: asyncio.Event,
                       stop: asyncio.Event) -> None:
        config = GatewayConfig(http_port=self.http_port, grpc_port=self.grpc_port)
        await run_gateway(self._recipes(address), config, ready=ready, stop=stop)

    def _recipes(self, address: dict[str, str]) -> dict[str, Recipe]:
        def endpoints(*names: str) -> dict[str, StageEndpoint]:
            return {name: StageEndpoint(name, address[name]) for name in names}

        image = Recipe(name="tiny", task=Task.TEXT_TO_IMAGE, model=str(self.models["dit"]),
                       stages=endpoints("tokenizer", "dit", "vae"),
                       image_defaults=ImageDefaults(width=32, height=32, num_inference_steps=2))
        speech = Recipe(name="speech", task=Task.TEXT_TO_SPEECH,
                        model=str(self.models["talker"]), stages=endpoints("talker", "codec"))
        return {"tiny": image, "speech": speech}


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path, make_stages_thread: Any) -> Iterator[Mesh]:
    mesh = Mesh(tiny_model_dir, ensure_speech_model(), make_stages_thread)
    mesh.stages.start()
    yield mesh
    mesh.stages.stop()


def client_fields(case: Case[Any]) -> set[str]:
    """What a client of this route can name: its body's top-level fields, its path and query
    parameters, the body itself and the request-id header."""
    operation = case.operation.definition.raw
    names = {"body", "x-request-id"}
    names |= {parameter["name"] for parameter in operation.get("parameters", [])}
    for media in operation.get("requestBody", {}).get("content", {}).values():
        schema = media["schema"]
        if "$ref" in schema:
            schema = case.operation.schema.raw_schema["components"]["schemas"][
                schema["$ref"].rsplit("/", 1)[1]]
        names |= set(schema.get("properties", {}))
    if isinstance(case.body, dict):
        names |= set(case.body)  # an unknown field is refused naming it
    if isinstance(case.query, dict):
        # so is an unknown query parameter (its name's first dotted part is what the check
        # compares, as for a body path such as messages[0].content)
        names |= set(case.query) | {name.split(".")[0] for name in case.query}
    return names


def check_answer(case: Case[Any], status: int, body: bytes) -> None:
    """No 5xx; a 4xx has the error body, and a 400 names a field the client sent or can send
    (never a stage's internal one)."""
    label = f"{case.operation.label} {case.body!r} {case.query!r} {case.path_parameters!r}"
    assert status < 500, f"{label} -> {status}: {body[:500]!r}"
    if status < 400:
        return
    error = json_object(body).get("error")
    assert isinstance(error, dict) and isinstance(error.get("message"), str), (
        f"{label} -> {status} without the error body: {body[:500]!r}")
    if status == 400:
        param, fields = error.get("param"), client_fields(case)
        # a body path such as messages[0].content names its field by its first dotted part; a
        # field whose own name has a dot (an unknown "Hello." the fuzzer sent) by its whole name
        assert isinstance(param, str) and (param in fields or param.split(".")[0] in fields), (
            f"{label} -> 400 naming no field of the request: {body[:500]!r}")


def json_object(body: bytes) -> dict[str, object]:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def test_openapi_lists_every_route(mesh: Mesh) -> None:
    """The document covers the OpenAI routes and every annotated native route."""
    schema = schemathesis.openapi.from_url(f"{mesh.url}/openapi.json")
    paths = set(schema.raw_schema["paths"])
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/audio/speech",
            "/v1/chat/completions"} <= paths
    assert {binding.path for binding in http_bindings()} <= paths


def test_one_step_is_refused_up_front_and_two_steps_make_an_image(mesh: Mesh) -> None:
    """Found by this suite: with one step the flow-match schedule stretched to its terminal
    shift divides 0 by 0 and the latents were NaN, so the VAE refused them naming `latents`, a
    field the client never sent. The DiT now publishes its minimum (2 for such a model) and a
    1-step request is a 400 naming num_inference_steps before any stage runs."""
    def generate(steps: int) -> httpx.Response:
        body = {"prompt": "a red circle", "size": "32x32", "num_inference_steps": steps}
        return httpx.post(f"{mesh.url}/v1/images/generations", json=body,
                          timeout=REQUEST_TIMEOUT_S)

    refused = generate(1)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "num_inference_steps"
    assert generate(2).status_code == 200


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_5xx_and_every_4xx_names_its_field(
    mesh: Mesh, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{mesh.url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def send(case: Case[Any]) -> None:
            response = case.call(base_url=mesh.url, timeout=REQUEST_TIMEOUT_S)
            check_answer(case, response.status_code, response.content)

        try:
            send()
        except AssertionError as error:
            failures.append(str(error))
        except hypothesis.errors.Unsatisfiable:  # nothing to break (a GET without parameters)
            assert mode is GenerationMode.NEGATIVE, operation.label
    assert not failures, "\n".join(failures)
