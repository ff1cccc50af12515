"""Video request validation: the frame rule the DiT publishes (4k+1 for Wan), seconds x fps
rounded up to it, the Wan 2.2 knobs only where the model has them, the input image rules, and
the form fields of POST /v1/videos (every refusal a 400 naming its field)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.stages import ImageFacts, VideoFacts
from stagemesh.gateway.recipes import VideoDefaults
from stagemesh.gateway.videos.protocol import (
    VideoRequest,
    form_from_json,
    image_from_reference,
    resolve_video_request,
    round_up_frames,
    video_request,
)
from stagemesh.gateway.videos.routes import video_object
from stagemesh.gateway.videos.store import JobRecord, JobStatus, Runner
from stagemesh.gateway.wire.forms import Form, FormFile
from stagemesh.shared.proto.v1 import common_pb2

IMAGE = ImageFacts(max_prompt_chars=100, size_multiple=16, max_side=128, max_pixels=128 * 128,
                   max_steps=20, max_true_cfg_scale=10.0, max_images_per_request=1, min_steps=1,
                   execution_modes=(common_pb2.EXECUTION_MODE_STEP,))
T2V = VideoFacts(image=IMAGE, max_frames=33, frame_multiple=4, max_condition_images=0,
                 has_second_transformer=False, accepts_flow_shift=True, can_encode=True,
                 task="text-to-video")
I2V = VideoFacts(image=IMAGE, max_frames=33, frame_multiple=4, max_condition_images=1,
                 has_second_transformer=True, accepts_flow_shift=True, can_encode=True,
                 task="image-to-video")
DEFAULTS = VideoDefaults(width=32, height=32, num_frames=9, fps=8, num_inference_steps=4,
                         guidance_scale=5.0)


def png(width: int = 20, height: int = 10) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def refused(request: VideoRequest, facts: VideoFacts = T2V) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        resolve_video_request(request, DEFAULTS, facts)
    return raised.value


@pytest.mark.parametrize(("frames", "expected"), [
    (1, 1), (2, 5), (5, 5), (6, 9), (16, 17), (17, 17), (18, 21), (80, 81)])
def test_frame_counts_round_up_to_the_next_4k_plus_1(frames: int, expected: int) -> None:
    assert round_up_frames(frames, 4) == expected


@pytest.mark.parametrize(("frames", "expected"), [
    (1, 9), (9, 9), (10, 21), (16, 21), (21, 21), (22, 33)])
def test_frame_counts_round_up_to_whole_transformer_tokens(frames: int, expected: int) -> None:
    """A transformer with 3 latent frames per token (tiny-shapes-video) takes 9, 21, 33 ..."""
    assert round_up_frames(frames, 4, 3) == expected


#: tiny-shapes-video's rule: 4k+1 frames whose k+1 latent frames are a multiple of 3.
WHOLE_TOKENS = dataclasses.replace(T2V, frame_patch=3)


def test_seconds_round_up_to_whole_transformer_tokens() -> None:
    params = resolve_video_request(VideoRequest(prompt="x", seconds=2), DEFAULTS, WHOLE_TOKENS)
    assert params.num_frames == 21  # 2 s at 8 fps = 16 frames: 17 would be 5 latent frames


@pytest.mark.parametrize("frames", [5, 13, 17])
def test_num_frames_off_whole_tokens_is_a_400_listing_the_counts(frames: int) -> None:
    error = refused(VideoRequest(prompt="x", num_frames=frames), WHOLE_TOKENS)
    assert error.field_name == "num_frames"
    assert "one of 9, 21, 33" in error.message, error.message


def test_defaults_fill_every_field() -> None:
    params = resolve_video_request(VideoRequest(prompt="a cat", seed=3), DEFAULTS, T2V)
    assert (params.width, params.height, params.num_frames, params.fps) == (32, 32, 9, 8)
    assert (params.num_inference_steps, params.guidance_scale, params.seed) == (4, 5.0, 3)
    assert params.negative_prompt == "" and params.image is None
    assert params.guidance_scale_2 is None and params.boundary_ratio is None
    assert params.flow_shift is None  # the model's own shift


@pytest.mark.parametrize("frames", [2, 4, 8, 10, 0, -3])
def test_num_frames_off_the_rule_is_a_400_naming_it(frames: int) -> None:
    error = refused(VideoRequest(prompt="x", num_frames=frames))
    assert error.field_name == "num_frames" and "4k+1" in error.message


def test_num_frames_wins_over_seconds_and_fps() -> None:
    params = resolve_video_request(VideoRequest(prompt="x", num_frames=13, seconds=3.0, fps=8),
                                   DEFAULTS, T2V)
    assert (params.num_frames, params.fps) == (13, 8)


@pytest.mark.parametrize(("seconds", "fps", "frames"), [
    (2.0, 8, 17), (1.0, 8, 9), (1.5, 8, 13), (0.1, 8, 1), (2.0, 6, 13), (0.5, 16, 9)])
def test_seconds_times_fps_round_up_to_the_rule(seconds: float, fps: int, frames: int) -> None:
    params = resolve_video_request(VideoRequest(prompt="x", seconds=seconds, fps=fps),
                                   DEFAULTS, T2V)
    assert (params.num_frames, params.fps) == (frames, fps)


def test_more_frames_than_the_model_takes_names_the_field_that_asked() -> None:
    assert refused(VideoRequest(prompt="x", num_frames=37)).field_name == "num_frames"
    assert refused(VideoRequest(prompt="x", seconds=10.0)).field_name == "seconds"


@pytest.mark.parametrize(("request_", "field"), [
    (VideoRequest(prompt=""), "prompt"),
    (VideoRequest(prompt="x", fps=0), "fps"),
    (VideoRequest(prompt="x", seconds=-1.0), "seconds"),
    (VideoRequest(prompt="x", seconds=float("nan")), "seconds"),
    (VideoRequest(prompt="x", width=40, height=32), "size"),
    (VideoRequest(prompt="x", num_inference_steps=21), "num_inference_steps"),
    (VideoRequest(prompt="x", guidance_scale=11.0), "guidance_scale"),
    (VideoRequest(prompt="x", seed=-1), "seed"),
    (VideoRequest(prompt="x", flow_shift=0.0), "flow_shift"),
])
def test_each_bad_field_is_named(request_: VideoRequest, field: str) -> None:
    assert refused(request_).field_name == field


@pytest.mark.parametrize("knob", ["guidance_scale_2", "boundary_ratio"])
def test_wan22_knobs_are_refused_by_a_one_transformer_model(knob: str) -> None:
    error = refused(VideoRequest(prompt="x", **{knob: 0.5}))  # type: ignore[arg-type]
    assert error.field_name == knob and "second" in error.message


def test_wan22_knobs_pass_where_the_model_has_a_second_transformer() -> None:
    params = resolve_video_request(
        VideoRequest(prompt="x", guidance_scale_2=3.5, boundary_ratio=0.875, flow_shift=5.0,
                     image=png()), DEFAULTS, I2V)
    assert (params.guidance_scale_2, params.boundary_ratio, params.flow_shift) == (
        3.5, 0.875, 5.0)
    assert refused(VideoRequest(prompt="x", boundary_ratio=1.5, image=png()),
                   I2V).field_name == "boundary_ratio"


def test_flow_shift_is_refused_where_the_scheduler_has_none() -> None:
    facts = dataclasses.replace(T2V, accepts_flow_shift=False)
    assert refused(VideoRequest(prompt="x", flow_shift=3.0), facts).field_name == "flow_shift"


def test_image_to_video_needs_an_image_and_text_to_video_takes_none() -> None:
    assert refused(VideoRequest(prompt="x"), I2V).field_name == "input_reference"
    error = refused(VideoRequest(prompt="x", image=png(), image_field="image_reference"))
    assert error.field_name == "image_reference"
    params = resolve_video_request(VideoRequest(prompt="x", image=png(20, 10)), DEFAULTS, I2V)
    assert params.image is not None and params.image.shape == (10, 20, 3)
    assert params.image.dtype == np.uint8 and tuple(params.image[0, 0]) == (200, 10, 10)


def test_an_input_image_that_is_no_image_names_its_field() -> None:
    error = refused(VideoRequest(prompt="x", image=b"not an image"), I2V)
    assert error.field_name == "input_reference"


def test_image_reference_takes_a_data_url_and_refuses_remote_urls() -> None:
    data = png()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert image_from_reference(json.dumps({"image_url": url})) == data
    assert image_from_reference(json.dumps({"image_url": {"url": url}})) == data
    for bad in (json.dumps({"image_url": "https://example.com/a.png"}), "{not json",
                json.dumps({"image_url": "data:image/png;base64,@@@"}), json.dumps({}),
                json.dumps({"image_url": "data:text/plain;base64,aGk="})):
        with pytest.raises(InvalidRequest) as raised:
            image_from_reference(bad)
        assert raised.value.field_name == "image_reference"
    with pytest.raises(InvalidRequest, match="fetches no URLs"):
        image_from_reference(json.dumps({"image_url": "http://example.com/a.png"}))


def form(**fields: str) -> Form:
    return Form(fields={name: [value] for name, value in fields.items()})


def test_form_fields_are_typed_and_named() -> None:
    request = video_request(form(prompt="a cat", size="48x32", seconds="4", fps="8",
                                 num_frames="17", seed="42", guidance_scale="6.5",
                                 num_inference_steps="30", model="wan"))
    assert (request.width, request.height, request.seconds, request.fps) == (48, 32, 4.0, 8)
    assert (request.num_frames, request.seed, request.guidance_scale) == (17, 42, 6.5)
    assert (request.num_inference_steps, request.model) == (30, "wan")
    for name, value in (("num_frames", "many"), ("seed", "1.5"), ("seconds", "long"),
                        ("size", "big"), ("colour", "red")):
        with pytest.raises(InvalidRequest) as raised:
            video_request(form(prompt="x", **{name: value}))
        assert raised.value.field_name == name


def test_both_references_are_refused() -> None:
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    both = Form(fields={"prompt": ["x"], "image_reference": [json.dumps({"image_url": url})]},
                files={"input_reference": [FormFile("a.png", "image/png", png())]})
    with pytest.raises(InvalidRequest) as raised:
        video_request(both)
    assert raised.value.field_name == "image_reference"
    one = Form(fields={"prompt": ["x"]},
               files={"input_reference": [FormFile("a.png", "image/png", png())]})
    request = video_request(one)
    assert request.image == png() and request.image_field == "input_reference"


def test_a_json_body_reads_as_the_same_form() -> None:
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    request = video_request(form_from_json({"prompt": "x", "num_frames": 9, "seconds": 2.5,
                                            "image_reference": {"image_url": url}}))
    assert (request.num_frames, request.seconds, request.image) == (9, 2.5, png())
    bodies: list[dict[str, object]] = [{"prompt": "x", "input_reference": "abc"},
                                       {"prompt": "x", "seed": True}, {"prompt": ["x"]}]
    for body in bodies:
        with pytest.raises(InvalidRequest):
            form_from_json(body)


def test_the_job_json_is_openais_video_object() -> None:
    record = JobRecord(id="video_1", owner="", model="wan", prompt="x", width=48, height=32,
                       num_frames=17, fps=8, seed=1, status=JobStatus.FAILED, created_at=100.0,
                       runner=Runner("h", 1, "i"), progress=0.456, completed_at=160.0,
                       error="boom", error_code="internal")
    body = video_object(record, max_age_s=3600)
    assert body["object"] == "video" and body["status"] == "failed"
    assert (body["progress"], body["seconds"], body["size"]) == (46, "2.125", "48x32")
    assert (body["created_at"], body["completed_at"], body["expires_at"]) == (100, 160, 3760)
    assert body["error"] == {"code": "internal", "message": "boom"}
    cancelled = video_object(dataclasses.replace(record, status=JobStatus.CANCELLED,
                                                 error_code="cancelled"), max_age_s=3600)
    assert cancelled["status"] == "failed"  # OpenAI's statuses: the SDK's poll ends on it
    assert cancelled["error"] == {"code": "cancelled", "message": "boom"}


def test_frames_times_size_over_the_dits_video_limit_names_the_frames() -> None:
    facts = dataclasses.replace(T2V, max_video_pixels=9 * 32 * 32)
    assert resolve_video_request(VideoRequest(prompt="x", num_frames=9), DEFAULTS,
                                 facts).num_frames == 9
    assert refused(VideoRequest(prompt="x", num_frames=13), facts).field_name == "num_frames"
    assert refused(VideoRequest(prompt="x", seconds=2.0), facts).field_name == "seconds"


def test_a_second_guidance_needs_the_first() -> None:
    error = refused(VideoRequest(prompt="x", guidance_scale=1.0, guidance_scale_2=3.0,
                                 image=png()), I2V)
    assert error.field_name == "guidance_scale_2"
