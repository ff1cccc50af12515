"""Image edit through the whole gateway (uvicorn REST + the public gRPC port) over fake
stages: in-process grpc.aio servers that publish an edit model's facts through their Describe
RPCs, record what they are sent, and answer with tiny canned tensors (no model).

What is checked: the unmodified openai SDK's `images.edit` (one image, n=2, a size), chat with
an input image, the native REST and gRPC EditImage; the Tokenizer and the VAE's EncodeImage
get the input image side by side and the DiT its latents; every refusal names its field and
calls no stage; a cancel by id mid-edit stops the DiT and no VAE decode runs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
from PIL import Image

from stagemesh.gateway.app import GatewayConfig, run_gateway
from stagemesh.gateway.recipes import EDIT_DEFAULTS, ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.serve import free_port
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    dit_service_pb2_grpc,
    gateway_service_pb2,
    gateway_service_pb2_grpc,
)
from stagemesh.shared.tensors import array_from_proto, array_to_proto
from tests.integration.fake_stages import (
    FakeTokenizer,
    FakeVae,
    cancel_watch,
    serve_fakes,
    start_message,
)

pytestmark = pytest.mark.timeout(60)
on_module_loop = pytest.mark.asyncio(loop_scope="module")

#: The DiT's step time when a test needs an edit to still be running.
SLOW_STEP_S = 0.2


def png(width: int, height: int, colour: str = "red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def size_of(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def edit_tokenizer() -> FakeTokenizer:
    """An edit model's tokenizer: one input image of at most 256 x 256."""
    return FakeTokenizer(max_images=1, max_image_pixels=256 * 256)


def edit_vae() -> FakeVae:
    """An edit model's VAE: it encodes input images."""
    return FakeVae(size_multiple=16, max_side=2048, can_encode=True, level=200)


@dataclass
class EditDit(dit_service_pb2_grpc.DitServiceServicer):
    task: str = "image-edit"
    step_seconds: float = 0.0
    starts: list[Any] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # ids it stopped on a cancel message

    async def DescribeDit(self, request: Any, context: Any) -> Any:
        return dit_service_pb2.DescribeDitResponse(
            stage=common_pb2.StageDescription(stage="dit"), size_multiple=16, max_side=128,
            max_pixels=128 * 128, max_steps=50, max_true_cfg_scale=10.0,
            max_images_per_request=2, min_steps=1, max_condition_images=1, task=self.task,
            execution_modes=[common_pb2.EXECUTION_MODE_STEP])

    async def Denoise(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = await start_message(requests)
        self.starts.append(start)
        async with cancel_watch(requests) as cancel:
            yield dit_service_pb2.DenoiseResponse(queued=common_pb2.Queued(position=0))
            for step in range(1, start.num_inference_steps + 1):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), self.step_seconds or 0.001)
                if cancel.is_set():
                    self.aborted.append(start.request_id)
                    yield dit_service_pb2.DenoiseResponse(aborted=common_pb2.Aborted(
                        step_index=step - 1, reason=common_pb2.ABORT_REASON_CANCELLED))
                    return
                yield dit_service_pb2.DenoiseResponse(progress=common_pb2.Progress(
                    step_index=step, total_steps=start.num_inference_steps))
            yield dit_service_pb2.DenoiseResponse(result=dit_service_pb2.DenoiseResult(
                latents=array_to_proto(np.full((1, 1), start.seed, np.float32)),
                height=start.height, width=start.width, steps=start.num_inference_steps))


@dataclass
class Served:
    http_url: str
    grpc_target: str
    tokenizer: FakeTokenizer
    dit: EditDit
    vae: FakeVae
    http: httpx.AsyncClient
    own_area_vae: FakeVae  # the "own-area" recipe's: it encodes at 32 x 32 pixels

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.http_url}/v1", api_key="unused",
                                  max_retries=0, timeout=30)

    def reset(self) -> None:
        self.tokenizer.starts.clear()
        self.dit.starts.clear()
        self.dit.aborted.clear()
        self.dit.step_seconds = 0.0
        self.vae.encodes.clear()
        self.vae.decodes.clear()

    def stages_called(self) -> int:
        return (len(self.tokenizer.starts) + len(self.dit.starts) + len(self.vae.encodes)
                + len(self.vae.decodes))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[Served]:
    """The fake edit stages, a fake text-to-image DiT (an edit recipe on it is misconfigured)
    and a gateway with an edit recipe, a text-to-image recipe and a misconfigured one."""
    servicers: dict[str, Any] = {"tokenizer": edit_tokenizer(), "dit": EditDit(),
                                 "vae": edit_vae()}
    servers, addresses = await serve_fakes(servicers)
    wrong_servers, wrong = await serve_fakes({"tokenizer": edit_tokenizer(),
                                              "dit": EditDit(task="text-to-image"),
                                              "vae": edit_vae()})
    own_area_vae = replace(edit_vae(), condition_area=32 * 32)
    own_servers, own_area = await serve_fakes({"tokenizer": edit_tokenizer(), "dit": EditDit(),
                                               "vae": own_area_vae})

    def stages(at: dict[str, str]) -> dict[str, StageEndpoint]:
        return {name: StageEndpoint(name, address) for name, address in at.items()}

    recipes = {
        "edit": Recipe("edit", Task.IMAGE_EDIT, "m", stages(addresses),
                       replace_steps(EDIT_DEFAULTS, 3)),
        "draw": Recipe("draw", Task.TEXT_TO_IMAGE, "m", stages(addresses),
                       ImageDefaults(width=16, height=16, num_inference_steps=3)),
        "not-edit": Recipe("not-edit", Task.IMAGE_EDIT, "m", stages(wrong),
                           replace_steps(EDIT_DEFAULTS, 3)),
        "own-area": Recipe("own-area", Task.IMAGE_EDIT, "m", stages(own_area),
                           replace_steps(EDIT_DEFAULTS, 3)),
    }
    config = GatewayConfig(http_port=free_port(), grpc_port=free_port())
    ready, stop = asyncio.Event(), asyncio.Event()
    gateway = asyncio.create_task(run_gateway(recipes, config, ready, stop))
    await asyncio.wait_for(ready.wait(), 30)
    url = f"http://127.0.0.1:{config.http_port}"
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield Served(url, f"127.0.0.1:{config.grpc_port}", servicers["tokenizer"],
                     servicers["dit"], servicers["vae"], http, own_area_vae)
    stop.set()
    await gateway
    for server in (*servers.values(), *wrong_servers.values(), *own_servers.values()):
        await server.stop(0)


def replace_steps(defaults: ImageDefaults, steps: int) -> ImageDefaults:
    return ImageDefaults(width=defaults.width, height=defaults.height,
                         num_inference_steps=steps, true_cfg_scale=defaults.true_cfg_scale,
                         negative_prompt=defaults.negative_prompt)


@on_module_loop
async def test_the_openai_sdk_edits_an_image(served: Served) -> None:
    served.reset()
    result = await served.client().images.edit(
        model="edit", image=("cat.png", png(64, 48), "image/png"), prompt="make it blue",
        n=2, size="32x16", extra_body={"seed": 5, "num_inference_steps": 2,
                                       "true_cfg_scale": 2.5, "negative_prompt": "red"})
    assert result.data is not None and len(result.data) == 2
    for image in result.data:
        assert image.b64_json is not None
        assert size_of(base64.b64decode(image.b64_json)) == (32, 16)
    # the tokenizer read the image with the prompt; the VAE encoded it at the stock size
    (tokenizer,) = served.tokenizer.starts
    assert tokenizer.prompt == "make it blue" and tokenizer.negative_prompt == "red"
    assert [array_from_proto(image).shape for image in tokenizer.images] == [(48, 64, 3)]
    (encode,) = served.vae.encodes
    assert (encode.width, encode.height) == (1184, 896)  # calculate_dimensions(1024², 4/3)
    assert array_from_proto(encode.image).shape == (48, 64, 3)
    # each image is its own DiT request, conditioned on the encoded latents
    assert sorted(start.seed for start in served.dit.starts) == [5, 6]
    for start in served.dit.starts:
        assert (start.width, start.height, start.num_inference_steps) == (32, 16, 2)
        assert start.true_cfg_scale == 2.5
        (condition,) = start.condition_latents
        assert array_from_proto(condition).shape == (1, 4, 1, 2, 2)
    assert len(served.vae.decodes) == 2


@on_module_loop
async def test_the_sdk_sends_a_list_of_images_as_image_brackets(served: Served) -> None:
    served.reset()
    with pytest.raises(openai.BadRequestError) as error:
        await served.client().images.edit(
            model="edit", image=[("a.png", png(8, 8), "image/png"),
                                 ("b.png", png(8, 8), "image/png")], prompt="merge them")
    assert error.value.body["param"] == "image"  # type: ignore[index]
    assert "at most 1 image" in error.value.body["message"]  # type: ignore[index]
    assert served.stages_called() == 0  # refused before any stage ran


@on_module_loop
async def test_the_default_size_is_derived_from_the_input_image(served: Served) -> None:
    served.reset()
    result = await served.client().images.edit(
        model="edit", image=("wide.png", png(160, 90), "image/png"), prompt="p")
    assert result.data is not None and result.data[0].b64_json is not None
    width, height = size_of(base64.b64decode(result.data[0].b64_json))
    # the stock 1376x768, fitted to the DiT's published 128x128 at the same aspect ratio
    assert (width, height) == (128, 64) and served.vae.encodes[0].width == 1376


@on_module_loop
async def test_an_input_image_is_encoded_at_the_area_the_vae_publishes(served: Served) -> None:
    """A model that conditions at its own area (tiny-shapes-edit: 32 x 32) says so in its
    VAE's Describe; the gateway sizes the encode, and the default output, by it."""
    served.own_area_vae.encodes.clear()
    result = await served.client().images.edit(
        model="own-area", image=("wide.png", png(160, 90), "image/png"), prompt="p")
    assert result.data is not None and result.data[0].b64_json is not None
    # calculate_dimensions(32 * 32, 16 / 9): sides of 42.7 and 24 rounded to 32
    assert size_of(base64.b64decode(result.data[0].b64_json)) == (32, 32)
    (encode,) = served.own_area_vae.encodes
    assert (encode.width, encode.height) == (32, 32)


def as_parts(fields: dict[str, str]) -> list[tuple[str, tuple[None, str]]]:
    """Text fields as multipart parts (httpx sends `data=` alone url-encoded)."""
    return [(name, (None, value)) for name, value in fields.items()]


@on_module_loop
@pytest.mark.parametrize(("fields", "image", "param"), [
    ({"true_cfg_scale": "10.5"}, png(8, 8), "true_cfg_scale"),  # the DiT's guidance range
    ({"size": "32x32", "width": "64"}, png(8, 8), "size"),  # size conflicts with width
    ({"size": "40x40"}, png(8, 8), "size"),  # not a multiple of 16
    ({"size": "256x256"}, png(8, 8), "size"),  # over the DiT's max_side
    ({}, png(300, 300), "image"),  # over the Tokenizer's max_image_pixels
    ({}, b"hello", "image"),  # not an image
    ({}, None, "image"),  # no image
    ({"model": "nope"}, png(8, 8), "model"),
    ({"model": "draw"}, png(8, 8), "model"),  # a text-to-image recipe
    ({"model": "not-edit"}, png(8, 8), "model"),  # its DiT does not edit images
    ({"response_format": "url"}, png(8, 8), "response_format"),
    ({"mask": "x"}, png(8, 8), "mask"),
    ({"step_cache_threshold": "0.1"}, png(8, 8), "step_cache_threshold"),  # the DiT has none
    ({"preview_every": "x"}, png(8, 8), "preview_every"),
])
async def test_bad_edits_are_refused_naming_the_field_before_any_stage(
    served: Served, fields: dict[str, str], image: bytes | None, param: str,
) -> None:
    served.reset()
    parts: list[Any] = as_parts({"prompt": "p", "model": "edit", **fields})
    if image is not None:
        parts.append(("image", ("a.png", image, "image/png")))
    response = await served.http.post("/v1/images/edits", files=parts)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert served.stages_called() == 0


@on_module_loop
async def test_a_body_that_is_not_a_form_is_refused(served: Served) -> None:
    served.reset()
    response = await served.http.post("/v1/images/edits", json={"prompt": "p"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"
    assert served.stages_called() == 0


@on_module_loop
async def test_cancel_by_id_mid_edit_stops_the_dit_and_nothing_is_decoded(
    served: Served, wait_until: Any,
) -> None:
    served.reset()
    served.dit.step_seconds = SLOW_STEP_S
    edit = asyncio.create_task(served.http.post(
        "/v1/images/edits", data={"prompt": "p", "model": "edit", "num_inference_steps": "40",
                                  "seed": "1", "size": "16x16"},
        files={"image": ("a.png", png(16, 16), "image/png")},
        headers={"x-request-id": "edit-to-cancel"}))
    await wait_until(lambda: len(served.dit.starts) == 1, timeout=10, what="the DiT starting")
    cancel = await served.http.post("/v1/requests/edit-to-cancel/cancel", json={})
    assert cancel.status_code == 200, cancel.text
    assert cancel.json()["stage"] == "dit"
    response = await edit
    assert response.status_code == 499 and response.json()["error"]["code"] == "cancelled"
    assert served.dit.aborted == ["edit-to-cancel"]
    assert served.vae.decodes == []  # the VAE never decoded it


@on_module_loop
async def test_chat_with_an_input_image_answers_with_the_edited_image(served: Served) -> None:
    served.reset()
    url = "data:image/png;base64," + base64.b64encode(png(40, 30)).decode()
    completion = await served.client().chat.completions.create(
        model="edit", messages=[{"role": "user", "content": [
            {"type": "text", "text": "make it blue"},
            {"type": "image_url", "image_url": {"url": url}}]}],
        extra_body={"size": "48x32", "seed": 2})
    content: Any = completion.choices[0].message.content
    assert isinstance(content, list) and content[0]["type"] == "image_url"
    data = content[0]["image_url"]["url"].split(",", 1)[1]
    assert size_of(base64.b64decode(data)) == (48, 32)
    assert served.tokenizer.starts[0].prompt == "make it blue"
    with pytest.raises(openai.BadRequestError) as error:
        await served.client().chat.completions.create(
            model="edit", messages=[{"role": "user", "content": "make it blue"}])
    assert error.value.body["param"] == "messages"  # type: ignore[index]


@on_module_loop
async def test_native_rest_and_grpc_edit_image(served: Served) -> None:
    served.reset()
    image = png(20, 20)
    response = await served.http.post("/v1/images:edit", json={
        "model": "edit", "prompt": "p", "images": [base64.b64encode(image).decode()],
        "width": 16, "height": 32, "seed": "3", "num_inference_steps": 2})
    lines = [json.loads(line) for line in response.text.splitlines()]
    results = [line["result"] for line in lines if "result" in line]
    assert response.status_code == 200 and len(results) == 1
    png_bytes = base64.b64decode(results[0]["images"][0]["png"])
    assert size_of(png_bytes) == (16, 32)
    async with grpc.aio.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        replies = [reply async for reply in stub.EditImage(gateway_service_pb2.EditImageRequest(
            model="edit", prompt="p", images=[image], n=2, seed=8, num_inference_steps=1,
            step_cache_threshold=0))]
        images = [i for reply in replies if reply.HasField("result")
                  for i in reply.result.images]
        assert sorted(i.seed for i in images) == [8, 9]
        assert [s.HasField("step_cache_threshold") for s in served.dit.starts[-2:]] == [True] * 2
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stub.EditImage(gateway_service_pb2.EditImageRequest(
                    model="edit", prompt="p", images=[image, image])):
                pass
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@on_module_loop
async def test_a_streamed_edit_reports_the_vae_encode_the_steps_and_each_image(
    served: Served,
) -> None:
    served.reset()
    response = await served.http.post(
        "/v1/images/edits", files=[*as_parts({"prompt": "p", "model": "edit", "stream": "true",
                                              "size": "16x16", "num_inference_steps": "2",
                                              "seed": "4"}),
                                   ("image", ("a.png", png(8, 8), "image/png"))])
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in response.text.split("\n\n")
              if line.startswith("data: {")]
    assert events[0]["type"] == "request"
    assert {"type": "queued", "stage": "vae", "position": 0} in events  # the encode's
    assert [e["step"] for e in events if e["type"] == "progress" and e["stage"] == "dit"] == [
        1, 2]
    (image,) = [e for e in events if e["type"] == "image"]
    assert image["seed"] == 4 and size_of(base64.b64decode(image["b64_json"])) == (16, 16)
    assert events[-1] == {"type": "done"} and response.text.endswith("data: [DONE]\n\n")


@on_module_loop
async def test_an_unknown_field_is_named_as_the_client_named_it(served: Served) -> None:
    """httpx (as browsers) escapes `"` and control characters in a part's name (%22, %0D); the
    400 names the field the client sent, not its escaped form (found by the fuzz suite)."""
    served.reset()
    for name in ('odd\r\n"name', "tab\there"):
        response = await served.http.post(
            "/v1/images/edits", data={"prompt": "p", name: "x"},
            files={"image": ("a.png", png(8, 8), "image/png")})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == name
    assert served.stages_called() == 0
