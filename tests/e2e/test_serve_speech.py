"""End to end text-to-speech: `stagemesh serve` (default recipes) driven by the openai SDK, httpx
and the generated gRPC stub."""

from __future__ import annotations

import base64
import io
import struct
import time

import grpc
import httpx
import numpy as np
import openai
import pytest
import soundfile

from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "csm-tiny"
RATE = 24_000
SAMPLES_PER_FRAME = 1920  # Mimi: 24 kHz / 12.5 frames per second
HEADER = 44


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0)


def speech_body(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "voice": "vivian", "input": "Hello there", "seed": 11,
            "max_new_tokens": 10, **fields}


def wav_samples(data: bytes) -> np.ndarray:
    """int16 samples of a one-shot WAV, after checking its header says 24 kHz mono int16."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    with soundfile.SoundFile(io.BytesIO(data)) as wav:
        assert (wav.samplerate, wav.channels, wav.subtype) == (RATE, 1, "PCM_16")
        return wav.read(dtype="int16")


def streamed(served, **fields: object) -> tuple[bytes, float, float]:
    """(body, seconds to the first audio bytes, seconds to the end) of a stream=true request."""
    started = time.monotonic()
    first_at, body = None, b""
    with httpx.stream("POST", f"{served.http_url}/v1/audio/speech", timeout=60,
                      json=speech_body(stream=True, **fields)) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "audio/wav"
        for chunk in response.iter_bytes():
            if first_at is None and len(body) + len(chunk) > HEADER:
                first_at = time.monotonic() - started
            body += chunk
    assert first_at is not None
    return body, first_at, time.monotonic() - started


def test_openai_sdk_gets_a_24khz_mono_int16_wav(client: openai.OpenAI) -> None:
    response = client.audio.speech.create(model=MODEL, voice="vivian", input="Hello there",
                                          extra_body={"max_new_tokens": 10, "seed": 11})
    samples = wav_samples(response.content)
    assert samples.shape == (10 * SAMPLES_PER_FRAME,) and np.abs(samples).max() > 0
    header = response.content[:HEADER]
    assert struct.unpack("<I", header[40:44])[0] == samples.nbytes  # real sizes, not streaming


def test_streamed_audio_starts_early_and_matches_the_one_shot_audio(
    served, client: openai.OpenAI,
) -> None:
    frames = 40
    body, first_at, total = streamed(served, max_new_tokens=frames)
    assert body[:4] == b"RIFF" and body[8:12] == b"WAVE"
    assert struct.unpack("<I", body[40:44])[0] == 0xFFFFFFFF  # streaming WAV: length unknown
    audio = np.frombuffer(body[HEADER:], dtype="<i2")
    assert audio.shape == (frames * SAMPLES_PER_FRAME,)
    # The first chunk is decoded after 5 of the 40 frames, while the talker keeps generating.
    assert first_at < 0.5 * total, (first_at, total)
    one_shot = client.audio.speech.create(model=MODEL, voice="vivian", input="Hello there",
                                          extra_body={"max_new_tokens": frames, "seed": 11})
    assert np.abs(wav_samples(one_shot.content).astype(int) - audio).max() <= 1


def test_the_sdk_streaming_response_variant_works(client: openai.OpenAI) -> None:
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="vivian", input="Hello there",
            extra_body={"stream": True, "max_new_tokens": 10, "seed": 11}) as response:
        chunks = list(response.iter_bytes())
    data = b"".join(chunks)
    assert data[:4] == b"RIFF" and len(data) == HEADER + 10 * SAMPLES_PER_FRAME * 2


def test_pcm_is_raw_int16_of_the_same_audio(client: openai.OpenAI) -> None:
    pcm = client.audio.speech.create(model=MODEL, voice="vivian", input="Hello there",
                                     response_format="pcm",
                                     extra_body={"max_new_tokens": 10, "seed": 11}).content
    wav = client.audio.speech.create(model=MODEL, voice="vivian", input="Hello there",
                                     extra_body={"max_new_tokens": 10, "seed": 11}).content
    assert pcm == wav[HEADER:]


def test_flac_decodes_to_the_same_samples(client: openai.OpenAI) -> None:
    flac = client.audio.speech.create(model=MODEL, voice="vivian", input="Hello there",
                                      response_format="flac",
                                      extra_body={"max_new_tokens": 10, "seed": 11}).content
    samples, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    wav = client.audio.speech.create(model=MODEL, voice="vivian", input="Hello there",
                                     extra_body={"max_new_tokens": 10, "seed": 11}).content
    assert rate == RATE and np.array_equal(samples, wav_samples(wav))


def _wav_data_url(seconds: float, rate: int = 8_000) -> str:
    buffer = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(buffer, 0.3 * np.sin(2 * np.pi * 220 * t), rate, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_voice_clone_from_a_data_url(served) -> None:
    response = httpx.post(f"{served.http_url}/v1/audio/speech", timeout=60, json=speech_body(
        task_type="Base", voice="clone", ref_audio=_wav_data_url(1.0), ref_text="A tone."))
    assert response.status_code == 200, response.text
    assert wav_samples(response.content).shape == (10 * SAMPLES_PER_FRAME,)


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": ""}, "input"),
    ({"input": "x" * 4097}, "input"),
    ({"voice": "nobody"}, "voice"),
    ({"response_format": "mp3"}, "response_format"),
    ({"speed": 1.5}, "speed"),
    ({"task_type": "Other"}, "task_type"),
    ({"task_type": "Base"}, "ref_audio"),
    ({"task_type": "Base", "ref_audio": base64.b64encode(b"not audio").decode()}, "ref_audio"),
    ({"task_type": "Base", "ref_audio": "%%%"}, "ref_audio"),
    ({"task_type": "Base", "ref_audio": _wav_data_url(31.0)}, "ref_audio"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"model": "no-such-model"}, "model"),
    ({"stream": True, "voice": "nobody"}, "voice"),
])
def test_bad_input_is_a_400_naming_the_field(served, fields: dict, param: str) -> None:
    response = httpx.post(f"{served.http_url}/v1/audio/speech", json=speech_body(**fields),
                          timeout=30)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error",
                                                              "invalid_argument")


def test_the_openai_sdk_raises_bad_request_on_an_unknown_voice(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model=MODEL, voice="nobody", input="Hello")  # type: ignore[arg-type]


def test_voices_are_listed(served) -> None:
    # csm-tiny is not the default speech recipe any more (piper-joe is: test_serve_voice.py).
    reply = httpx.get(f"{served.http_url}/v1/audio/voices", params={"model": MODEL},
                      timeout=10).json()
    assert reply["model"] == MODEL and {"vivian", "ryan"} <= set(reply["voices"])
    unknown = httpx.get(f"{served.http_url}/v1/audio/voices", params={"model": "nobody"},
                        timeout=10)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "model"


def _stage_counts(served) -> dict[str, float]:
    return {f"{stage}/{what}": served.metric(stage, name, **labels)
            for stage in ("talker", "codec")
            for what, name, labels in (
                ("steps", "stagemesh_steps_total", {}),
                ("aborted", "stagemesh_requests_finished_total", {"status": "aborted"}),
                ("held", "stagemesh_requests_running", {}),
                ("waiting", "stagemesh_requests_waiting", {}))}


def test_a_disconnect_mid_stream_stops_talker_and_codec(served, wait_until) -> None:
    before = _stage_counts(served)
    with httpx.stream("POST", f"{served.http_url}/v1/audio/speech", timeout=60,
                      json=speech_body(stream=True, max_new_tokens=500)) as response:
        assert response.status_code == 200
        next(response.iter_bytes())  # audio is flowing; now the client goes away
    wait_until(lambda: all(_stage_counts(served)[f"{s}/aborted"] == before[f"{s}/aborted"] + 1
                           for s in ("talker", "codec")),
               timeout=15, what="talker and codec each aborting the gone client's request")
    # With no request running or waiting in either stage, neither can take another step.
    wait_until(lambda: all(_stage_counts(served)[f"{s}/{what}"] == 0
                           for s in ("talker", "codec") for what in ("held", "waiting")),
               timeout=15, what="talker and codec holding no request")
    stopped = _stage_counts(served)
    assert stopped["talker/steps"] - before["talker/steps"] < 500
    # The next request is unaffected.
    body, _, _ = streamed(served, max_new_tokens=5)
    assert len(body) == HEADER + 5 * SAMPLES_PER_FRAME * 2


def test_grpc_synthesize_speech_streams_the_same_bytes(served) -> None:
    rest, _, _ = streamed(served)
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        replies = list(stub.SynthesizeSpeech(pb.SynthesizeSpeechRequest(
            model=MODEL, input="Hello there", voice="vivian", seed=11, max_new_tokens=10,
            request_id="grpc-tts-1"), timeout=60))
        with pytest.raises(grpc.RpcError) as failure:
            list(stub.SynthesizeSpeech(pb.SynthesizeSpeechRequest(
                model=MODEL, input="Hello there", voice="nobody"), timeout=30))
    assert {r.request_id for r in replies} == {"grpc-tts-1"}
    assert {r.sample_rate for r in replies} == {RATE}
    assert b"".join(r.audio for r in replies) == rest
    error = parse_rpc_error(failure.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and error.field_name == "voice"
