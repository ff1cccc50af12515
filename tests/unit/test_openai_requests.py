"""OpenAI request bodies -> typed request records: the JSON shape is read once, and every
refusal names its field (limits are checked later, against what the stages publish)."""

from __future__ import annotations

import base64

import pytest

from stagemesh.gateway.chat.protocol import chat_image_request, last_user_text
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.protocol import ImageRequest, image_request
from stagemesh.gateway.speech.protocol import SpeechRequest, speech_request
from stagemesh.gateway.wire.requests import openai_body, ref_audio_bytes
from stagemesh.shared.proto.v1 import common_pb2


def test_an_image_body_becomes_an_image_request() -> None:
    request = image_request({
        "model": "tiny", "prompt": "a cat", "negative_prompt": "", "n": 2, "size": "64x32",
        "num_inference_steps": 9, "true_cfg_scale": 3, "seed": 4, "execution_mode": "request",
        "response_format": "b64_json", "stream": True, "timeout": 5, "user": "ignored",
        "priority": -3})
    assert request == ImageRequest(prompt="a cat", model="tiny", negative_prompt="", n=2,
                                   width=64, height=32, num_inference_steps=9,
                                   true_cfg_scale=3.0, seed=4,
                                   execution_mode=common_pb2.EXECUTION_MODE_REQUEST,
                                   priority=-3)


def test_absent_image_fields_stay_unset() -> None:
    assert image_request({"prompt": "a cat"}) == ImageRequest(prompt="a cat")
    assert image_request({}) == ImageRequest(prompt="")  # refused later, naming `prompt`


def test_width_and_height_are_read_when_size_is_absent_and_guidance_scale_is_an_alias() -> None:
    request = image_request({"prompt": "x", "width": 48, "height": 16, "guidance_scale": 2.5})
    assert (request.width, request.height, request.true_cfg_scale) == (48, 16, 2.5)


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "model": 1}, "model"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "size": 512}, "size"),
    ({"prompt": "x", "width": "64"}, "width"),
    ({"prompt": "x", "height": 6.4}, "height"),
    ({"prompt": "x", "num_inference_steps": "9"}, "num_inference_steps"),
    ({"prompt": "x", "true_cfg_scale": "high"}, "true_cfg_scale"),
    ({"prompt": "x", "guidance_scale": False}, "true_cfg_scale"),
    ({"prompt": "x", "seed": 1.0}, "seed"),
    ({"prompt": "x", "negative_prompt": ["no"]}, "negative_prompt"),
    ({"prompt": "x", "execution_mode": "fast"}, "execution_mode"),
    ({"prompt": "x", "priority": "high"}, "priority"),
    ({"prompt": "x", "priority": 1.5}, "priority"),
    ({"prompt": "x", "priority": True}, "priority"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
])
def test_image_body_refusals_name_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        image_request(body)
    assert error.value.field_name == field


def test_extra_body_sent_literally_is_merged() -> None:
    body = openai_body({"prompt": "x", "seed": 1, "extra_body": {"seed": 2, "n": 3}})
    assert body == {"prompt": "x", "seed": 2, "n": 3}
    assert openai_body({"prompt": "x", "extra_body": "junk"}) == {"prompt": "x"}


def test_a_chat_body_draws_the_last_user_message() -> None:
    request = chat_image_request({
        "model": "tiny", "size": "64x64", "width": 48, "height": 32, "seed": 3,
        "messages": [{"role": "user", "content": "first"},
                     {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": [{"type": "text", "text": "a red"},
                                                  {"type": "image_url", "image_url": {}},
                                                  {"type": "text", "text": "circle"}]}]})
    assert request == ImageRequest(prompt="a red circle", model="tiny", width=48, height=32,
                                   seed=3)
    assert chat_image_request({"messages": [{"role": "user", "content": "x"}],
                               "size": "16x16"}).width == 16


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": "system", "content": "x"}],
                                      [{"role": "user", "content": 5}]])
def test_chat_bodies_without_user_text_name_messages(messages: object) -> None:
    with pytest.raises(InvalidRequest) as error:
        last_user_text(messages)
    assert error.value.field_name == "messages"


def test_a_speech_body_becomes_a_speech_request() -> None:
    clip = base64.b64encode(b"RIFF....").decode()
    request, stream = speech_request({
        "model": "csm", "input": "Hello", "voice": "Vivian", "response_format": "pcm",
        "speed": 1, "task_type": "Base", "language": "en", "instructions": "calm",
        "ref_audio": f"data:audio/wav;base64,{clip}", "ref_text": "hi", "seed": 3,
        "max_new_tokens": 40, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stream": True,
        "stream_format": "audio"})
    assert stream is True
    assert request == SpeechRequest(
        input="Hello", model="csm", voice="Vivian", response_format="pcm", speed=1.0,
        task_type="Base", language="en", instructions="calm", ref_audio=b"RIFF....",
        ref_text="hi", seed=3, max_new_tokens=40, temperature=0.5, top_p=0.9, top_k=20)


def test_absent_speech_fields_stay_unset() -> None:
    assert speech_request({"input": "Hi"}) == (SpeechRequest(input="Hi"), False)


@pytest.mark.parametrize(("body", "field"), [
    ({"input": 3}, "input"),
    ({"input": "x", "voice": 1}, "voice"),
    ({"input": "x", "speed": "fast"}, "speed"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "stream_format": "sse"}, "stream_format"),
    ({"input": "x", "seed": "1"}, "seed"),
    ({"input": "x", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"input": "x", "temperature": None, "top_k": "5"}, "top_k"),
    ({"input": "x", "ref_audio": 7}, "ref_audio"),
    ({"input": "x", "ref_audio": "%%%"}, "ref_audio"),
    ({"input": "x", "ref_audio": "https://example.com/a.wav"}, "ref_audio"),
])
def test_speech_body_refusals_name_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        speech_request(body)
    assert error.value.field_name == field


def test_ref_audio_is_a_data_url_or_bare_base64() -> None:
    payload = base64.b64encode(b"\x00\x01clip").decode()
    assert ref_audio_bytes(f"data:audio/flac;codecs=flac;base64,{payload}") == b"\x00\x01clip"
    assert ref_audio_bytes(f" {payload[:4]}\n{payload[4:]} ") == b"\x00\x01clip"


def test_a_chat_body_takes_its_priority_from_extra_body() -> None:
    body = openai_body({"messages": [{"role": "user", "content": "a cat"}],
                        "extra_body": {"priority": 7}})
    assert chat_image_request(body).priority == 7
