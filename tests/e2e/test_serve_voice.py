"""The default voice end to end: `stagemesh serve` answers the OpenAI SDK with speech that
Whisper understands, lists the voice the model really has, and refuses a clone it cannot do."""

from __future__ import annotations

import io

import httpx
import numpy as np
import openai
import pytest
import soundfile

pytest.importorskip("piper", reason="the Piper voice needs the voice-gpl extra")
pytest.importorskip("faster_whisper")

from stagemesh.models.intelligibility import Transcriber, word_error_rate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "piper-joe"
SENTENCE = "Hello there, how are you today?"


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0)


def test_the_default_voice_says_what_it_is_asked(client: openai.OpenAI) -> None:
    wav = client.audio.speech.create(model=MODEL, voice="default", input=SENTENCE,
                                     response_format="wav").content
    pcm, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == 22_050 and 1.0 < pcm.shape[0] / rate < 4.0
    heard = Transcriber()(np.asarray(pcm, dtype=np.float32), rate)
    assert word_error_rate([SENTENCE], [heard]) <= 0.05, heard


def test_the_voices_are_the_models_own_and_it_is_the_default_speech_model(served) -> None:
    reply = httpx.get(f"{served.http_url}/v1/audio/voices", params={"model": MODEL},
                      timeout=30).json()
    assert reply == {"model": MODEL, "voices": ["joe"]}
    # No model named: the first text-to-speech recipe, the default voice.
    assert httpx.get(f"{served.http_url}/v1/audio/voices", timeout=30).json() == reply


def test_a_clone_is_a_400_saying_the_model_cannot(served) -> None:
    response = httpx.post(f"{served.http_url}/v1/audio/speech", timeout=30, json={
        "model": MODEL, "input": "Hi.", "voice": "clone", "task_type": "Base",
        "ref_audio": "data:audio/wav;base64,UklGRg=="})
    assert response.status_code == 400
    assert "cannot clone" in response.json()["error"]["message"]
