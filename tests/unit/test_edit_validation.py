"""Image-edit request validation: the input images (count, format, pixels, aspect ratio), the
size derived from them as the stock QwenImageEditPipeline derives it, the OpenAI multipart
form and the chat content parts; every refusal names its field before any stage runs."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

import grpc
import numpy as np
import pytest
from PIL import Image

from stagemesh.gateway.chat.routes import chat_edit_request
from stagemesh.gateway.errors import InvalidRequest, StageUnavailable
from stagemesh.gateway.images.edit_forms import edit_request
from stagemesh.gateway.images.edit_protocol import (
    EditParams,
    EditRequest,
    condition_size,
    decode_image,
    default_output_size,
    resolve_edit_request,
)
from stagemesh.gateway.images.protocol import ImageRequest
from stagemesh.gateway.mesh.stages import (
    DescribeCache,
    EditFacts,
    ImageFacts,
    Mesh,
    StageCatalog,
    VideoFacts,
)
from stagemesh.gateway.recipes import EDIT_DEFAULTS, Recipe, StageEndpoint, Task
from stagemesh.gateway.wire.forms import Form, FormFile
from stagemesh.gateway.wire.requests import image_data_url
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    tokenizer_service_pb2,
    vae_service_pb2,
)

IMAGE = ImageFacts(max_prompt_chars=200, size_multiple=16, max_side=2048,
                   max_pixels=1024 * 1024 + 200_000, max_steps=50, max_true_cfg_scale=10.0,
                   max_images_per_request=2, min_steps=2,
                   execution_modes=(common_pb2.EXECUTION_MODE_STEP,))
FACTS = EditFacts(image=IMAGE, max_images=1, max_image_pixels=4000 * 3000, can_encode=True,
                  task="image-edit", encode_size_multiple=16, encode_max_side=2048)


def encoded(width: int, height: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), "red" if mode != "P" else 1).save(buffer, format=fmt)
    return buffer.getvalue()


def resolve(*images: bytes, **fields: Any) -> EditParams:
    request = EditRequest(replace(ImageRequest(prompt="make it blue", seed=1), **fields), images)
    return resolve_edit_request(request, EDIT_DEFAULTS, FACTS)


# -- the size rule: diffusers' calculate_dimensions(1024 * 1024, width / height) ----------------

@pytest.mark.parametrize(("size", "expected"), [
    # computed with diffusers 0.42.1's pipeline_qwenimage_edit.calculate_dimensions (the
    # family's own rule is compared too, in tests/integration/test_edit_stages.py, where
    # diffusers is loaded anyway)
    ((64, 64), (1024, 1024)), ((640, 480), (1184, 896)), ((480, 640), (896, 1184)),
    ((1920, 1080), (1376, 768)), ((1000, 1), (32384, 32)), ((33, 17), (1440, 736)),
    ((3000, 2000), (1248, 832)), ((100, 700), (384, 2720)), ((512, 511), (1024, 1024)),
])
def test_the_condition_size_is_the_stock_pipelines(size: tuple[int, int],
                                                   expected: tuple[int, int]) -> None:
    assert condition_size(*size) == expected


def test_the_default_output_size_is_the_condition_size_fitted_to_the_limits() -> None:
    assert default_output_size(1184, 896, IMAGE) == (1184, 896)  # within the limits: as stock
    small = replace(IMAGE, max_pixels=64 * 64, max_side=96)
    width, height = default_output_size(1376, 768, small)
    assert width * height <= 64 * 64 and width % 16 == 0 and height % 16 == 0
    assert width > height  # the aspect ratio is kept (as far as multiples of 16 allow)
    assert default_output_size(1024, 1024, replace(IMAGE, max_side=512)) == (512, 512)


# -- input images ------------------------------------------------------------------------------

def test_an_image_decodes_to_rgb_whatever_its_mode() -> None:
    for mode in ("RGB", "RGBA", "L", "P"):
        pixels = decode_image(encoded(5, 3, mode=mode), 100)
        assert pixels.shape == (3, 5, 3) and pixels.dtype == np.uint8
    assert decode_image(encoded(4, 4, "JPEG"), 100).shape == (4, 4, 3)
    assert decode_image(encoded(4, 4, "WEBP"), 100).shape == (4, 4, 3)


def noise_png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("data", "message"), [
    (b"not an image", "not a PNG, JPEG or WebP"),
    (encoded(4, 4, "GIF"), "got GIF"),
    (encoded(11, 10), "more than the limit of 100 pixels"),
    (noise_png(10, 10)[:200], "could not be decoded"),  # truncated after its header
], ids=["garbage", "gif", "too-many-pixels", "truncated"])
def test_a_bad_image_is_refused_naming_it(data: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as error:
        decode_image(data, 100)
    assert error.value.field_name == "image"


def test_data_urls_of_images_are_read_and_remote_urls_refused() -> None:
    png = encoded(2, 2)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert image_data_url(url, "messages") == png
    for bad, message in (("https://example.com/cat.png", "fetches no URLs"),
                         ("data:text/plain;base64,aGk=", "base64 data URL"),
                         ("data:image/png;base64,***", "not valid base64")):
        with pytest.raises(InvalidRequest, match=message) as error:
            image_data_url(bad, "messages")
        assert error.value.field_name == "messages"


# -- the request -------------------------------------------------------------------------------

def test_the_output_size_defaults_to_the_size_derived_from_the_input_image() -> None:
    params = resolve(encoded(640, 480))
    assert (params.condition_width, params.condition_height) == (1184, 896)
    assert (params.image.width, params.image.height) == (1184, 896)
    assert params.inputs[0].shape == (480, 640, 3)
    given = resolve(encoded(640, 480), width=512, height=256)
    assert (given.image.width, given.image.height) == (512, 256)
    assert given.condition_width == 1184  # always the stock one


@pytest.mark.parametrize(("images", "fields", "param", "message"), [
    ((), {}, "image", "image is required"),
    ((encoded(8, 8), encoded(8, 8)), {}, "image", "at most 1 image per request, got 2"),
    ((encoded(1000, 1),), {}, "image", "aspect ratio"),
    ((b"GIF89a",), {}, "image", "not a PNG"),
    ((encoded(8, 8),), {"true_cfg_scale": 10.5}, "true_cfg_scale", r"\[0, 10\]"),
    ((encoded(8, 8),), {"width": 100, "height": 64}, "size", "multiple of 16"),
    ((encoded(8, 8),), {"n": 3}, "n", "between 1 and 2"),
    ((encoded(8, 8),), {"prompt": " "}, "prompt", "non-empty"),
])
def test_bad_edits_are_refused_naming_the_field(images: tuple[bytes, ...],
                                                fields: dict[str, Any], param: str,
                                                message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as error:
        resolve(*images, **fields)
    assert error.value.field_name == param


# -- the OpenAI form ---------------------------------------------------------------------------

def form(files: dict[str, list[bytes]] | None = None, **fields: str) -> Form:
    return Form(fields={name: [value] for name, value in fields.items()},
                files={name: [FormFile("x.png", "image/png", data) for data in datas]
                       for name, datas in (files or {"image": [b"png"]}).items()})


def test_the_openai_form_is_read_typed() -> None:
    request, stream = edit_request(form(
        {"image[]": [b"a", b"b"]}, prompt="blue", model="edit", n="2", size="64x32", seed="7",
        num_inference_steps="3", true_cfg_scale="2.5", negative_prompt="red",
        response_format="b64_json", user="someone"))
    assert request.images == (b"a", b"b") and not stream
    image = request.image
    assert (image.prompt, image.model, image.n, image.width, image.height) == (
        "blue", "edit", 2, 64, 32)
    assert (image.seed, image.num_inference_steps, image.true_cfg_scale) == (7, 3, 2.5)
    assert image.negative_prompt == "red"
    auto, stream = edit_request(form(prompt="p", size="auto", guidance_scale="4", stream="true"))
    assert (auto.image.width, auto.image.height, auto.image.true_cfg_scale) == (None, None, 4.0)
    assert stream


@pytest.mark.parametrize(("the_form", "param"), [
    (form(prompt="p", size="64x64", width="32"), "size"),  # size conflicts with width
    (form(prompt="p", size="big"), "size"),
    (form(prompt="p", n="two"), "n"),
    (form(prompt="p", true_cfg_scale="nan"), "true_cfg_scale"),
    (form(prompt="p", response_format="url"), "response_format"),
    (form(prompt="p", output_format="jpeg"), "output_format"),
    (form({"image": [b"x"], "mask": [b"m"]}, prompt="p"), "mask"),
    (form(prompt="p", colour="red"), "colour"),
    (form(prompt="p", stream="maybe"), "stream"),
    (form({}, prompt="p", image="not a file"), "image"),
])
def test_a_bad_form_is_refused_naming_the_field(the_form: Form, param: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        edit_request(the_form)
    assert error.value.field_name == param


# -- chat --------------------------------------------------------------------------------------

def test_chat_edits_take_the_image_of_the_last_user_message() -> None:
    png = encoded(3, 2)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    request = chat_edit_request({"model": "edit", "messages": [
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "make it"},
                                     {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "blue"}]}],
        "seed": 3, "size": "32x32"})
    assert request.images == (png,)
    assert (request.image.prompt, request.image.seed, request.image.width) == (
        "make it blue", 3, 32)


@pytest.mark.parametrize("content", [
    "make it blue",  # no image
    [{"type": "text", "text": "make it blue"},
     {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
    [{"type": "text", "text": "make it blue"}, {"type": "image_url", "image_url": 5}],
])
def test_chat_edits_without_a_data_url_image_are_refused_naming_messages(content: object
                                                                         ) -> None:
    with pytest.raises(InvalidRequest) as error:
        chat_edit_request({"messages": [{"role": "user", "content": content}]})
    assert error.value.field_name == "messages"


# -- what the stages publish -------------------------------------------------------------------

def test_edit_and_video_facts_take_what_every_stage_publishes() -> None:
    tokenizer = tokenizer_service_pb2.DescribeTokenizerResponse(
        max_prompt_chars=100, max_images=3, max_image_pixels=4096)
    dit = dit_service_pb2.DescribeDitResponse(
        size_multiple=16, max_side=512, max_pixels=512 * 512, max_steps=20,
        max_true_cfg_scale=8.0, max_images_per_request=2, min_steps=2,
        max_condition_images=1, task="image-edit", max_frames=33, frame_multiple=4,
        has_second_transformer=True, accepts_flow_shift=True)
    vae = vae_service_pb2.DescribeVaeResponse(size_multiple=8, max_side=256, can_encode=True,
                                              max_frames=17)
    edit = EditFacts.published(tokenizer, dit, vae)
    assert (edit.max_images, edit.max_image_pixels, edit.can_encode, edit.task) == (
        1, 4096, True, "image-edit")  # the fewer images of Tokenizer and DiT
    assert (edit.encode_size_multiple, edit.encode_max_side) == (8, 256)  # the VAE's own
    assert edit.image == ImageFacts.published(tokenizer, dit, vae)
    assert edit.image.max_side == 256 and edit.image.size_multiple == 16
    video = VideoFacts.published(tokenizer, dit, vae)
    assert (video.max_frames, video.frame_multiple, video.max_condition_images) == (17, 4, 1)
    assert video.has_second_transformer and video.accepts_flow_shift and video.can_encode
    dit.ClearField("max_frames")
    assert VideoFacts.published(tokenizer, dit, vae).max_frames == 0  # an image DiT: no video


class _Unstarted(Mesh):
    """A mesh whose channels are never used (the Describe calls below are stand-ins)."""

    def channel(self, endpoint: StageEndpoint) -> grpc.aio.Channel:
        return cast(grpc.aio.Channel, object())


async def _closed_under_it(channel: grpc.aio.Channel) -> object:
    """A Describe whose channel a balancer closed under it."""
    raise asyncio.CancelledError()


def _waits_after(gate: asyncio.Event) -> Callable[[grpc.aio.Channel], Awaitable[object]]:
    """A Describe that sets `gate` and then never answers."""

    async def waits(channel: grpc.aio.Channel) -> object:
        gate.set()
        await asyncio.Event().wait()
        return None

    return waits


async def test_a_describe_cancelled_under_the_request_is_a_503_naming_the_stage() -> None:
    """A replica's channel closed during a Describe (the balancer replaces a failed one) ends
    the call with a CancelledError though nobody cancelled the request: a 503, not a crash.
    A cancelled request still stops as cancelled."""
    recipe = Recipe("r", Task.IMAGE_EDIT, "m", {name: StageEndpoint(name, f"127.0.0.1:{port}")
                                                for port, name in enumerate(("tokenizer", "dit",
                                                                             "vae"), 1)})
    catalog = StageCatalog(_Unstarted({"r": recipe}))
    gate = asyncio.Event()
    waits = _waits_after(gate)
    with pytest.raises(StageUnavailable, match=r"vae stage at 127\.0\.0\.1:3 is unavailable"):
        await catalog.read(DescribeCache("vae", _closed_under_it), recipe)
    reading = asyncio.create_task(catalog.read(DescribeCache("vae", waits), recipe))
    await gate.wait()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


async def test_a_stage_list_row_whose_describe_is_cancelled_under_it_is_unreadable() -> None:
    """/v1/stages reads every stage's facts (`answer`): a Describe whose channel closes under it
    (a restarting stage) leaves that row's facts empty instead of failing the whole list with
    a 500; a cancelled caller still stops as cancelled."""
    endpoint = StageEndpoint("dit", "127.0.0.1:2")
    catalog = StageCatalog(_Unstarted({"r": Recipe("r", Task.IMAGE_EDIT, "m", {"dit": endpoint})}))
    gate = asyncio.Event()
    waits = _waits_after(gate)
    catalog.dit = cast(Any, DescribeCache("dit", _closed_under_it))
    assert await catalog.answer(endpoint) is None
    catalog.dit = cast(Any, DescribeCache("dit", waits))
    reading = asyncio.create_task(catalog.answer(endpoint))
    await gate.wait()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
