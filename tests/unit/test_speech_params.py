"""Speech request validation against what the Talker and Codec publish (SpeechFacts)."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import soundfile

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.stages import SpeechFacts
from stagemesh.gateway.speech.audio import AudioFormat
from stagemesh.gateway.speech.protocol import (
    SpeechParams,
    SpeechRequest,
    SpeechTask,
    resolve_speech_request,
)
from stagemesh.shared.limits import CLONE_VOICE, DEFAULT_VOICE, MAX_SEED
from stagemesh.shared.proto.v1 import codec_service_pb2, talker_service_pb2

FACTS = SpeechFacts(voices=("vivian", "ryan"), default_voice="vivian",
                    supports_voice_clone=True, max_input_chars=100,
                    max_reference_text_chars=50, max_new_frames=300, default_max_new_frames=250,
                    max_temperature=2.0, max_top_k=1000, max_reference_seconds=3.0,
                    reference_sample_rates=(16_000, 24_000))


def wav(seconds: float, rate: int = 16_000, channels: int = 1) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 220 * t)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.stack([tone] * channels, axis=1), rate, format="WAV")
    return buffer.getvalue()


def resolve(**fields: object) -> SpeechParams:
    return resolve_speech_request(replace(SpeechRequest(input="Hello"), **fields), FACTS)


def test_defaults_leave_the_frame_budget_and_voice_to_the_talker() -> None:
    params = resolve(seed=3)
    assert params == SpeechParams(input="Hello", voice=DEFAULT_VOICE,
                                  response_format=AudioFormat.WAV,
                                  task_type=SpeechTask.CUSTOM_VOICE, seed=3, max_new_frames=0)


def test_given_fields_are_kept_and_voice_names_are_lower_case() -> None:
    params = resolve(voice=" Ryan ", response_format="FLAC", speed=1.0, language="en",
                     instructions="  calm ", seed=MAX_SEED, max_new_tokens=300,
                     temperature=2.0, top_p=0.5, top_k=1000)
    assert (params.voice, params.response_format, params.max_new_frames) == (
        "ryan", AudioFormat.FLAC, 300)
    assert (params.temperature, params.top_p, params.top_k) == (2.0, 0.5, 1000)
    assert (params.language, params.instructions, params.seed) == ("en", "calm", MAX_SEED)
    assert resolve(voice="Default").voice == DEFAULT_VOICE


def test_a_voice_clone_decodes_the_reference_clip() -> None:
    params = resolve(task_type="Base", ref_audio=wav(1.0, channels=2), ref_text="A tone.")
    assert params.voice == CLONE_VOICE and params.task_type is SpeechTask.BASE
    assert params.reference is not None and params.reference.sample_rate == 16_000
    assert params.reference.samples.shape == (16_000,)
    assert params.reference.samples.dtype == np.float32
    assert params.ref_text == "A tone."
    assert resolve(task_type="Base", voice="ryan", ref_audio=wav(0.5)).voice == "ryan"


@pytest.mark.parametrize(("fields", "field"), [
    ({"input": ""}, "input"),
    ({"input": "  "}, "input"),
    ({"input": "x" * 101}, "input"),  # the talker's max_input_chars
    ({"language": "x" * 101}, "language"),
    ({"instructions": "x" * 101}, "instructions"),
    ({"ref_text": "x" * 51}, "ref_text"),  # the talker's max_reference_text_chars
    ({"response_format": "mp3"}, "response_format"),
    ({"speed": 1.5}, "speed"),
    ({"speed": 0.1}, "speed"),
    ({"task_type": "Other"}, "task_type"),
    ({"voice": "nobody"}, "voice"),
    ({"voice": "clone"}, "voice"),
    ({"task_type": "Base", "voice": "nobody", "ref_audio": b"x"}, "ref_audio"),
    ({"task_type": "Base"}, "ref_audio"),
    ({"ref_audio": b"x"}, "ref_audio"),  # a clip without task_type Base
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 301}, "max_new_tokens"),  # the talker's max_new_frames
    ({"seed": -1}, "seed"),
    ({"temperature": 2.5}, "temperature"),  # the talker's max_temperature
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 1001}, "top_k"),  # the talker's max_top_k
    ({"top_k": -1}, "top_k"),
])
def test_bad_fields_are_named(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        resolve(**fields)
    assert error.value.field_name == field


def test_an_unknown_voice_is_refused_with_the_published_voices() -> None:
    with pytest.raises(InvalidRequest, match=r"known: \[ryan, vivian\]"):
        resolve(voice="nobody")
    with pytest.raises(InvalidRequest, match="use 'clone' or one of"):
        resolve(voice="nobody", task_type="Base", ref_audio=wav(0.5))


@pytest.mark.parametrize(("clip", "message"), [
    (b"", "empty"),
    (b"not audio at all", "not a readable audio file"),
    (wav(3.5), r"3\.5 s long, the limit is 3 s"),  # the codec's max_reference_seconds
    (wav(0.5, rate=8_000), r"8000 Hz; accepted: \[16000, 24000\]"),  # reference_sample_rates
    (wav(0.0), "no samples"),
])
def test_reference_clips_are_checked_against_the_codec(clip: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as error:
        resolve(task_type="Base", ref_audio=clip)
    assert error.value.field_name == "ref_audio"


def test_a_model_that_cannot_clone_refuses_task_type_base() -> None:
    no_clone = replace(FACTS, supports_voice_clone=False)
    request = SpeechRequest(input="Hello", task_type="Base", ref_audio=wav(0.5))
    with pytest.raises(InvalidRequest) as error:
        resolve_speech_request(request, no_clone)
    assert error.value.field_name == "task_type"


def test_facts_combine_what_talker_and_codec_publish() -> None:
    facts = SpeechFacts.published(
        talker_service_pb2.DescribeTalkerResponse(
            voices=["vivian", "ryan"], default_voice="vivian", supports_voice_clone=True,
            max_input_chars=100, max_reference_text_chars=50, max_new_frames=300,
            default_max_new_frames=250, frame_rate=12.5, max_temperature=2.0, max_top_k=1000),
        codec_service_pb2.DescribeCodecResponse(
            sample_rate=24_000, frame_rate=12.5, num_codebooks=8, max_reference_seconds=3.0,
            reference_sample_rates=[16_000, 24_000]))
    assert facts == FACTS
