"""The gateway over fake stages: in-process grpc.aio servers that publish chosen facts through
their Describe RPCs and answer the stage streams with tiny canned tensors (no model).

What is checked: the gateway enforces what the stages publish (and re-reads it when a stage
comes back with other options), a stage it cannot read is a 503 naming the stage, and every
REST error (OpenAI routes, native routes, SSE events, NDJSON lines) has one body.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import soundfile

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import (
    common_pb2,
    gateway_service_pb2,
)
from tests.integration.fake_stages import (
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    FakeCodec,
    FakeDit,
    FakeTalker,
    FakeTokenizer,
    FakeVae,
    gateway_stub,
    serve_fake,
)

pytestmark = pytest.mark.timeout(60)

@dataclass
class Mesh:
    """Fake stages on fixed ports, the gateway core over them, and a REST client."""

    servicers: dict[str, Any]
    ports: dict[str, int]
    servers: dict[str, grpc.aio.Server]
    core: GatewayCore
    client: httpx.AsyncClient

    async def restart(self, stage: str, servicer: Any) -> None:
        await self.servers[stage].stop(0)
        self.servicers[stage] = servicer
        self.servers[stage], _ = await serve_fake(stage, servicer, self.ports[stage])


def recipes(ports: dict[str, int]) -> dict[str, Recipe]:
    def endpoints(*names: str) -> dict[str, StageEndpoint]:
        return {n: StageEndpoint(n, f"127.0.0.1:{ports[n]}") for n in names}

    return {"img": Recipe("img", Task.TEXT_TO_IMAGE, "m", endpoints("tokenizer", "dit", "vae"),
                          ImageDefaults(width=16, height=16, num_inference_steps=3)),
            "tts": Recipe("tts", Task.TEXT_TO_SPEECH, "m", endpoints("talker", "codec"))}


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    servicers = {"tokenizer": FakeTokenizer(), "dit": FakeDit(), "vae": FakeVae(),
                 "talker": FakeTalker(), "codec": FakeCodec()}
    servers, ports = {}, {}
    for stage, servicer in servicers.items():  # each binds a free port itself: no probe race
        servers[stage], ports[stage] = await serve_fake(stage, servicer)
    try:
        async with open_gateway(recipes(ports)) as core:
            transport = httpx.ASGITransport(app=build_rest_app(core))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                yield Mesh(servicers, ports, servers, core, client)
    finally:
        for server in servers.values():
            await server.stop(0)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


async def test_an_image_over_the_fake_stages(mesh: Mesh) -> None:
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "a cat", "size": "32x16", "n": 2, "seed": 4})
    assert response.status_code == 200, response.text
    assert [d["seed"] for d in response.json()["data"]] == [4, 5]
    assert response.headers["x-request-id"]
    assert [s.priority for s in mesh.servicers["dit"].starts] == [0, 0]  # the default


async def test_n_images_run_side_by_side_each_its_own_dit_request(mesh: Mesh) -> None:
    dit = mesh.servicers["dit"]
    dit.step_seconds = {4: 0.05}  # the first image is the slower one: it finishes last
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "a cat", "n": 2, "seed": 4, "num_inference_steps": 4, "priority": -5},
        headers={"x-request-id": "pair"})
    assert response.status_code == 200, response.text
    assert [d["seed"] for d in response.json()["data"]] == [4, 5]  # index order
    assert dit.most_in_flight == 2
    assert sorted((s.request_id, s.seed, s.priority) for s in dit.starts) == [
        ("pair.0", 4, -5), ("pair.1", 5, -5)]


async def test_sse_says_which_image_each_event_is_about(mesh: Mesh) -> None:
    mesh.servicers["dit"].step_seconds = {4: 0.05}
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "stream": True, "n": 2, "seed": 4, "num_inference_steps": 2})
    events = sse_events(response)
    images = [e for e in events if e["type"] == "image"]
    assert [(e["index"], e["seed"]) for e in images] == [(1, 5), (0, 4)]  # as each is done
    for index, seed in ((0, 4), (1, 5)):
        steps = [e["step"] for e in events
                 if e["type"] == "progress" and (e["index"], e["seed"]) == (index, seed)]
        assert steps == [1, 2]
    assert events[-1] == {"type": "done"}


async def test_one_failing_image_fails_the_request_and_cancels_the_others(
    mesh: Mesh, wait_until: Any,
) -> None:
    dit = mesh.servicers["dit"]
    dit.fail_at_step, dit.fail_seed = 2, 5
    dit.step_seconds = {4: 0.5}  # image 0 is still denoising when image 1 fails
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "n": 2, "seed": 4, "num_inference_steps": 10},
        headers={"x-request-id": "fails"})
    assert response.status_code == 400 and error_of(response)["param"] == "seed"
    await wait_until(lambda: dit.cancelled == ["fails.0"], timeout=5,
                     what="the DiT seeing image 0's call cancelled")
    assert dit.in_flight == 0


async def test_a_preempted_image_is_reported_on_sse_and_grpc(mesh: Mesh) -> None:
    mesh.servicers["dit"].preempt_at_step = 1
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "stream": True, "seed": 3, "num_inference_steps": 2, "priority": 9})
    preempted = [e for e in sse_events(response) if e["type"] == "preempted"]
    assert preempted == [{"type": "preempted", "stage": "dit", "step": 1, "index": 0,
                          "seed": 3}]
    assert mesh.servicers["dit"].starts[-1].priority == 9
    native = await mesh.client.post("/v1/images:generate", json={
        "prompt": "x", "seed": "3", "num_inference_steps": 2, "priority": 9})
    lines = [json.loads(line) for line in native.text.splitlines()]
    assert [line["preempted"] for line in lines if "preempted" in line] == [{"step_index": 1}]


@pytest.mark.parametrize("priority", [1001, -1001, "soon"])
async def test_a_priority_out_of_range_is_refused_naming_it(mesh: Mesh, priority: Any) -> None:
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "priority": priority})
    assert response.status_code == 400 and error_of(response)["param"] == "priority"
    assert mesh.servicers["dit"].starts == []


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": "x" * 101}, "prompt", "longer than 100"),  # the tokenizer's max_prompt_chars
    ({"prompt": "x", "num_inference_steps": 11}, "num_inference_steps", "between 1 and 10"),
    ({"prompt": "x", "size": "24x16"}, "size", "multiple of 16"),  # lcm(DiT 8, VAE 16)
    ({"prompt": "x", "size": "64x16"}, "size", "at most 48"),  # the VAE's max_side
    ({"prompt": "x", "true_cfg_scale": 5.5}, "true_cfg_scale", "[0, 5]"),
    ({"prompt": "x", "n": 3}, "n", "between 1 and 2"),
])
async def test_image_limits_are_the_ones_the_stages_publish(
    mesh: Mesh, body: dict[str, Any], param: str, message: str,
) -> None:
    response = await mesh.client.post("/v1/images/generations", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and message in error["message"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_argument")


async def test_stage_facts_are_read_once_and_again_after_a_restart(mesh: Mesh,
                                                                   wait_until: Any) -> None:
    for _ in range(3):
        response = await mesh.client.post("/v1/images/generations", json={"prompt": "x"})
        assert response.status_code == 200
    assert mesh.servicers["dit"].describes == 1 and mesh.servicers["tokenizer"].describes == 1
    refused = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "num_inference_steps": 15})
    assert error_of(refused)["param"] == "num_inference_steps"

    await mesh.restart("dit", FakeDit(max_steps=20))  # the operator raised the option

    async def accepts_15_steps() -> bool:
        response = await mesh.client.post("/v1/images/generations", json={
            "prompt": "x", "num_inference_steps": 15})
        return response.status_code == 200

    await wait_until(accepts_15_steps, timeout=20, what="the gateway reading the new DiT")
    assert mesh.servicers["tokenizer"].describes == 1  # only the restarted stage is read again


async def test_a_stage_that_cannot_be_read_is_a_503_naming_it(mesh: Mesh) -> None:
    await mesh.servers["vae"].stop(0)
    response = await mesh.client.post("/v1/images/generations", json={"prompt": "x"})
    assert response.status_code == 503
    error = error_of(response)
    assert f"vae stage at 127.0.0.1:{mesh.ports['vae']} is unavailable" in error["message"]
    assert error == {**error, "type": "service_unavailable", "param": None,
                     "code": "stage_unavailable"}
    native = await mesh.client.post("/v1/images:generate", json={"prompt": "x"})
    assert native.status_code == 503 and error_of(native)["code"] == "stage_unavailable"


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


async def test_sse_reports_progress_then_the_image(mesh: Mesh) -> None:
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "stream": True, "num_inference_steps": 2},
        headers={"x-request-id": "sse-1"})
    events = sse_events(response)
    assert events[0] == {"type": "request", "request_id": "sse-1"}
    assert [e["type"] for e in events[1:]] == ["queued", "progress", "progress", "image", "done"]
    assert events[2]["step"] == 1 and events[2]["stage"] == "dit"


async def test_a_stage_error_mid_stream_is_an_sse_error_event_with_the_error_body(
    mesh: Mesh,
) -> None:
    mesh.servicers["dit"].fail_at_step = 1
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "stream": True, "num_inference_steps": 3})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == {"type": "error", "error": {
        "message": "bad seed", "type": "invalid_request_error", "param": "seed",
        "code": "invalid_argument"}}
    assert "image" not in [e["type"] for e in events]


async def test_native_ndjson_ends_with_an_error_line_after_a_mid_stream_failure(
    mesh: Mesh,
) -> None:
    mesh.servicers["dit"].fail_at_step = 2
    response = await mesh.client.post("/v1/images:generate", json={
        "prompt": "x", "num_inference_steps": 3})
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert response.status_code == 200 and "queued" in lines[0]
    assert lines[-1] == {"error": {"message": "bad seed", "type": "invalid_request_error",
                                   "param": "seed", "code": "invalid_argument"}}


async def test_a_one_shot_error_has_the_same_body_on_openai_and_native_routes(
    mesh: Mesh,
) -> None:
    mesh.servicers["dit"].fail_at_step = 1
    openai_error = await mesh.client.post("/v1/images/generations", json={"prompt": "x"})
    mesh.servicers["dit"].fail_at_step = None
    native_error = await mesh.client.post("/v1/images:generate", json={"prompt": "x",
                                                                        "seed": "-1"})
    assert openai_error.status_code == 400 and error_of(openai_error)["param"] == "seed"
    assert native_error.status_code == 400 and error_of(native_error) == {
        "message": "seed must be between 0 and 9223372036854775806, got -1",
        "type": "invalid_request_error", "param": "seed", "code": "invalid_argument"}


async def test_voices_come_from_the_talker(mesh: Mesh) -> None:
    response = await mesh.client.get("/v1/audio/voices")
    assert response.json() == {"model": "tts", "voices": ["ava", "bo"]}
    missing = await mesh.client.get("/v1/audio/voices", params={"model": "img"})
    assert missing.status_code == 400 and error_of(missing)["param"] == "model"


def wav_clip(seconds: float, rate: int = SAMPLE_RATE) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(int(seconds * rate), np.float32), rate, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


async def test_speech_one_shot_and_streamed(mesh: Mesh) -> None:
    one_shot = await mesh.client.post("/v1/audio/speech", json={"input": "Hi", "voice": "Bo",
                                                                "max_new_tokens": 6})
    assert one_shot.status_code == 200 and one_shot.headers["content-type"] == "audio/wav"
    assert len(one_shot.content) == 44 + 6 * SAMPLES_PER_FRAME * 2
    streamed = await mesh.client.post("/v1/audio/speech", json={
        "input": "Hi", "voice": "bo", "max_new_tokens": 6, "stream": True})
    assert streamed.content[44:] == one_shot.content[44:]
    default = await mesh.client.post("/v1/audio/speech", json={"input": "Hi",
                                                               "response_format": "pcm"})
    assert len(default.content) == 4 * SAMPLES_PER_FRAME * 2  # the talker's default length
    starts = mesh.servicers["talker"].starts
    assert [s.voice for s in starts] == ["bo", "bo", "default"]
    assert [s.sampling.max_new_frames for s in starts] == [6, 6, 0]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"voice": "nobody"}, "voice", "known: [ava, bo]"),
    ({"input": "x" * 51}, "input", "the limit is 50"),
    ({"max_new_tokens": 13}, "max_new_tokens", "[1, 12]"),
    ({"temperature": 3.5}, "temperature", "[0, 3]"),
    ({"top_k": 101}, "top_k", "[0, 100]"),
    ({"task_type": "Base", "ref_audio": wav_clip(2.5)}, "ref_audio", "the limit is 2 s"),
    ({"task_type": "Base", "ref_audio": wav_clip(0.5, rate=16_000)}, "ref_audio", "16000 Hz"),
    ({"task_type": "Base", "ref_audio": wav_clip(0.5), "ref_text": "x" * 21}, "ref_text",
     "the limit is 20"),
    ({"stream": True, "voice": "nobody"}, "voice", "unknown voice"),
])
async def test_speech_limits_are_the_ones_the_stages_publish(
    mesh: Mesh, fields: dict[str, Any], param: str, message: str,
) -> None:
    response = await mesh.client.post("/v1/audio/speech", json={"input": "Hi", **fields})
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    error = error_of(response)
    assert error["param"] == param and message in error["message"]
    assert mesh.servicers["talker"].starts == []  # refused before the talker


async def test_a_voice_clone_sends_the_encoded_reference_to_the_talker(mesh: Mesh) -> None:
    response = await mesh.client.post("/v1/audio/speech", json={
        "input": "Hi", "task_type": "Base", "ref_audio": wav_clip(0.5), "ref_text": "hello",
        "max_new_tokens": 2})
    assert response.status_code == 200, response.text
    (start,) = mesh.servicers["talker"].starts
    assert (start.voice, start.reference_text, list(start.reference_codes.shape)) == (
        "clone", "hello", [3, 8])


async def test_the_grpc_api_runs_the_same_core(mesh: Mesh) -> None:
    async with gateway_stub(mesh.core) as stub:
        replies = [r async for r in stub.GenerateImage(gateway_service_pb2.GenerateImageRequest(
            prompt="x", num_inference_steps=2, seed=9, request_id="g-1", priority=-7),
            timeout=10)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.GenerateImage(gateway_service_pb2.GenerateImageRequest(
                    prompt="x", num_inference_steps=11), timeout=10):
                pass
        audio = [r async for r in stub.SynthesizeSpeech(
            gateway_service_pb2.SynthesizeSpeechRequest(input="Hi", max_new_tokens=2),
            timeout=10)]
    assert {r.request_id for r in replies} == {"g-1"}
    assert replies[-1].result.images[0].seed == 9
    assert mesh.servicers["dit"].starts[0].priority == -7
    error = parse_rpc_error(refused.value)
    assert (error.code, error.field_name) == (grpc.StatusCode.INVALID_ARGUMENT,
                                              "num_inference_steps")
    assert b"".join(r.audio for r in audio)[:4] == b"RIFF"
    assert {r.sample_rate for r in audio} == {SAMPLE_RATE}


def with_step_cache(mesh: Mesh, kind: str, threshold: float, maximum: float) -> None:
    dit = mesh.servicers["dit"]
    dit.step_cache, dit.step_cache_threshold, dit.max_step_cache_threshold = (
        kind, threshold, maximum)


async def test_step_cache_threshold_goes_to_the_dit_on_rest_chat_and_grpc(mesh: Mesh) -> None:
    with_step_cache(mesh, "first_block", 0.1, 0.4)
    dit = mesh.servicers["dit"]
    for threshold in (0.25, 0):
        response = await mesh.client.post("/v1/images/generations", json={
            "prompt": "x", "num_inference_steps": 2, "step_cache_threshold": threshold})
        assert response.status_code == 200, response.text
    chat = await mesh.client.post("/v1/chat/completions", json={
        "model": "img", "messages": [{"role": "user", "content": "a cat"}],
        "num_inference_steps": 2, "step_cache_threshold": 0.3})
    assert chat.status_code == 200, chat.text
    await mesh.client.post("/v1/images/generations", json={"prompt": "x",
                                                          "num_inference_steps": 2})
    async with gateway_stub(mesh.core) as stub:
        _ = [r async for r in stub.GenerateImage(gateway_service_pb2.GenerateImageRequest(
            prompt="x", num_inference_steps=2, step_cache_threshold=0.125), timeout=10)]
    sent = [s.step_cache_threshold if s.HasField("step_cache_threshold") else None
            for s in dit.starts]
    assert sent == [0.25, 0.0, pytest.approx(0.3), None, 0.125]  # unset: the stage's own


@pytest.mark.parametrize(("kind", "own", "asked"), [
    ("first_block", 0.1, 0.5),  # above the stage's maximum
    ("first_block", 0.1, -0.1),
    ("off", 0.0, 0.1),  # a stage without a cache publishes a maximum of 0
    ("taylorseer", 0.2, 0.1),  # a forecasting cache takes 0 or its own setting only
])
async def test_a_step_cache_threshold_the_dit_cannot_run_is_a_400_before_any_stage(
        mesh: Mesh, kind: str, own: float, asked: float) -> None:
    with_step_cache(mesh, kind, own, 0.4 if kind != "off" else 0.0)
    for path, body in (("/v1/images/generations", {"prompt": "x"}),
                       ("/v1/chat/completions", {"model": "img", "messages": [
                           {"role": "user", "content": "a cat"}]})):
        response = await mesh.client.post(path, json={**body, "step_cache_threshold": asked})
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == "step_cache_threshold"
    assert mesh.servicers["dit"].starts == [] and mesh.servicers["tokenizer"].starts == []


async def test_a_taylorseer_stage_takes_its_own_threshold(mesh: Mesh) -> None:
    with_step_cache(mesh, "taylorseer", 0.2, 0.4)
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "num_inference_steps": 2, "step_cache_threshold": 0.2})
    assert response.status_code == 200, response.text
    assert mesh.servicers["dit"].starts[0].step_cache_threshold == pytest.approx(0.2)


async def test_progress_says_which_steps_reused_the_cache_on_sse_and_ndjson(mesh: Mesh) -> None:
    mesh.servicers["dit"].reused_steps = frozenset({2})
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "stream": True, "num_inference_steps": 3})
    steps = [(e["step"], e["reused"]) for e in sse_events(response) if e["type"] == "progress"]
    assert steps == [(1, False), (2, True), (3, False)]
    native = await mesh.client.post("/v1/images:generate", json={
        "prompt": "x", "num_inference_steps": 3})
    lines = [json.loads(line) for line in native.text.splitlines()]
    progress = [line["progress"] for line in lines if "progress" in line]
    assert [(p["step_index"], p["reused"]) for p in progress] == [
        (1, False), (2, True), (3, False)]


def png_pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)))


async def test_previews_ride_on_the_progress_of_their_step_on_sse_and_grpc(mesh: Mesh) -> None:
    dit = mesh.servicers["dit"]
    dit.max_preview_size = 64
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "stream": True, "num_inference_steps": 4, "preview": {"every": 2}})
    progress = [e for e in sse_events(response) if e["type"] == "progress"]
    assert [e["step"] for e in progress] == [1, 2, 3, 4]  # one event a step, as without
    assert ["preview" in e for e in progress] == [False, True, False, True]
    prefix = "data:image/png;base64,"
    for event in progress[1::2]:
        assert event["preview"].startswith(prefix)
        pixels = png_pixels(base64.b64decode(event["preview"][len(prefix):]))
        assert pixels.shape == (4, 6, 3) and (pixels == event["step"]).all()
    assert (dit.starts[0].preview.every, dit.starts[0].preview.size) == (2, 32)  # the default
    async with gateway_stub(mesh.core) as stub:
        replies = [r async for r in stub.GenerateImage(gateway_service_pb2.GenerateImageRequest(
            prompt="x", num_inference_steps=2, preview=common_pb2.PreviewOptions(
                every=1, size=16)), timeout=10)]
    previews = [r.progress.preview for r in replies if r.HasField("progress")]
    assert [p.step_index for p in previews] == [1, 2]
    assert png_pixels(previews[1].png)[0, 0].tolist() == [2, 2, 2]
    assert dit.starts[1].preview.size == 16


async def test_a_dit_without_previews_runs_the_request_without_them(mesh: Mesh) -> None:
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "stream": True, "num_inference_steps": 2, "preview": {"every": 1}})
    progress = [e for e in sse_events(response) if e["type"] == "progress"]
    assert [("preview" in e) for e in progress] == [False, False]
    assert not mesh.servicers["dit"].starts[0].HasField("preview")


@pytest.mark.parametrize(("offered", "preview"), [
    (64, {"every": 1, "size": 65}),  # above its maximum
    (64, {"every": -1}),
    (64, {"every": 1, "colour": "red"}),
    (64, [1]),
])
async def test_previews_the_dit_cannot_make_are_a_400_naming_preview(
        mesh: Mesh, offered: int, preview: Any) -> None:
    mesh.servicers["dit"].max_preview_size = offered
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "preview": preview})
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == "preview"
    assert mesh.servicers["dit"].starts == []
def _lora_of(start: Any) -> list[tuple[str, float]]:
    return [(use.name, use.scale) for use in start.lora]


async def test_lora_reaches_the_dit_from_json_and_grpc(mesh: Mesh) -> None:
    response = await mesh.client.post("/v1/images/generations", json={
        "prompt": "x", "n": 2, "lora": [{"name": "ink", "scale": -0.5}, {"name": "wax"}]})
    assert response.status_code == 200, response.text
    dit = mesh.servicers["dit"]
    assert [_lora_of(s) for s in dit.starts] == [[("ink", -0.5), ("wax", 1.0)]] * 2
    async with gateway_stub(mesh.core) as stub:
        _ = [r async for r in stub.GenerateImage(gateway_service_pb2.GenerateImageRequest(
            prompt="x", num_inference_steps=2, lora=[common_pb2.LoraAdapter(name="wax",
                                                                            scale=1.5)]),
            timeout=10)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.GenerateImage(gateway_service_pb2.GenerateImageRequest(
                    prompt="x", lora=[common_pb2.LoraAdapter(name="nope")]), timeout=10):
                pass
    assert _lora_of(dit.starts[-1]) == [("wax", 1.5)]
    error = parse_rpc_error(refused.value)
    assert (error.code, error.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "lora")


@pytest.mark.parametrize(("lora", "message"), [
    ([{"name": "nope"}], "unknown adapter 'nope'"),
    ([{"name": "ink", "scale": 2.5}], "within ±2"),
    ([{"name": "ink"}, {"name": "wax"}, {"name": "ink"}], "at most 2"),
    ([{"name": "ink"}, {"name": "ink"}], "named twice"),
    ({"name": "ink"}, "array"),
    ([{"name": "ink", "weight": 1}], "optional"),
    ([{"name": "ink", "scale": "high"}], "must be a number"),
])
async def test_a_bad_lora_is_a_400_naming_it_before_any_stage_runs(
    mesh: Mesh, lora: Any, message: str
) -> None:
    response = await mesh.client.post("/v1/images/generations", json={"prompt": "x",
                                                                      "lora": lora})
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "lora" and message in error["message"], error
    assert mesh.servicers["dit"].starts == [] and mesh.servicers["tokenizer"].starts == []
