"""The transcription form and answers (gateway/transcriptions/protocol.py) and chat's
`input_audio` parts: shapes, refusals by field name, subtitles. No stage runs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile

from stagemesh.gateway.chat.protocol import chat_request
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.transcriptions.protocol import (
    ResponseFormat,
    Segment,
    decode_audio,
    decode_base64_audio,
    srt,
    transcription_request,
    vtt,
)
from stagemesh.gateway.wire.forms import Form, FormFile

SEGMENTS = (Segment(0, "Hello there.", 120, 1830), Segment(1, "Bye.", 3_723_004, 3_724_500))


def form(**fields: str | list[str]) -> Form:
    values = {k: v if isinstance(v, list) else [v] for k, v in fields.items()}
    return Form(fields=values, files={"file": [FormFile("a.wav", "audio/wav", b"RIFF")]})


def test_the_defaults_and_a_streamed_text_request() -> None:
    assert transcription_request(form()).response_format is ResponseFormat.JSON
    request = transcription_request(form(response_format="text", stream="true", language="EN"))
    assert request.stream and request.language == "en" and request.audio == b"RIFF"


@pytest.mark.parametrize(("fields", "field"), [
    ({"response_format": "srt", "stream": "true"}, "stream"),
    ({"response_format": "verbose_json", "stream": "true"}, "stream"),
    ({"response_format": "mp3"}, "response_format"),
    ({"timestamp_granularities[]": "word"}, "timestamp_granularities"),
    ({"timestamp_granularities[]": ["segment", "word"]}, "timestamp_granularities"),
    ({"temperature": "0.7"}, "temperature"),
    ({"speed": "2"}, "speed"),
])
def test_refusals_name_the_field(fields: dict[str, str | list[str]], field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        transcription_request(form(**fields))
    assert raised.value.field_name == field


def test_segment_timestamps_are_accepted() -> None:
    assert transcription_request(form(**{"timestamp_granularities[]": "segment"})).stream is False


def test_a_form_without_its_file_names_file() -> None:
    with pytest.raises(InvalidRequest) as raised:
        transcription_request(Form(fields={"model": ["whisper"]}))
    assert raised.value.field_name == "file"


def test_srt_and_vtt_cues() -> None:
    assert srt(SEGMENTS) == ("1\n00:00:00,120 --> 00:00:01,830\nHello there.\n\n"
                             "2\n01:02:03,004 --> 01:02:04,500\nBye.\n\n")
    assert vtt(SEGMENTS) == ("WEBVTT\n\n00:00:00.120 --> 00:00:01.830\nHello there.\n\n"
                             "01:02:03.004 --> 01:02:04.500\nBye.\n\n")


def test_audio_is_decoded_to_mono_or_refused_by_name() -> None:
    stereo = np.stack([np.full(800, 0.5), np.zeros(800)], axis=1).astype(np.float32)
    data = io.BytesIO()
    soundfile.write(data, stereo, 16_000, format="WAV", subtype="FLOAT")
    audio = decode_audio(data.getvalue(), "file")
    assert audio.sample_rate == 16_000 and audio.samples.shape == (800,)
    assert np.allclose(audio.samples, 0.25) and audio.seconds == pytest.approx(0.05)
    for bad in (b"", b"not audio"):
        with pytest.raises(InvalidRequest) as raised:
            decode_audio(bad, "file")
        assert raised.value.field_name == "file"
    with pytest.raises(InvalidRequest) as raised:
        decode_base64_audio("%%%", "messages[0].content[0].input_audio")
    assert raised.value.field_name == "messages[0].content[0].input_audio.data"


def _chat(part: dict[str, object], role: str = "user") -> dict[str, object]:
    return {"messages": [{"role": role, "content": [{"type": "text", "text": "Hi"}, part]}]}


def test_chat_keeps_input_audio_parts_for_the_listener() -> None:
    request, _ = chat_request(_chat({"type": "input_audio",
                                     "input_audio": {"data": "UklGRg==", "format": "mp3"}}))
    (turn,) = request.messages
    assert turn.content == "Hi" and len(turn.audio) == 1
    assert turn.audio[0].field == "messages[0].content[1].input_audio"


@pytest.mark.parametrize(("part", "role", "field"), [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}, "user",
     "messages[0].content[1].input_audio.format"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "user",
     "messages[0].content[1].input_audio.data"),
    ({"type": "input_audio", "input_audio": "AAAA"}, "user",
     "messages[0].content[1].input_audio"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "assistant",
     "messages.[0].content"),
])
def test_chat_refuses_bad_input_audio_by_name(part: dict[str, object], role: str,
                                              field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        chat_request(_chat(part, role))
    assert raised.value.field_name == field
