"""Chat over real stages: a Thinker (SmolLM2-135M-Instruct) and the Piper talker + codec, on
loopback, behind a real gateway (REST on uvicorn, gRPC), called with the openai SDK."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
import soundfile
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client import REGISTRY

from stagemesh.gateway.app import GatewayConfig, open_gateway, run_gateway
from stagemesh.gateway.realtime.protocol import SessionConfig
from stagemesh.gateway.realtime.session import RealtimeSession
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.models.registry import resolve_model
from stagemesh.models.smollm2 import ensure_smollm2
from stagemesh.serve import free_port
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc, thinker_service_pb2
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage

pytestmark = pytest.mark.timeout(240)
#: The async tests share the module's loop, where the module's stages and gateway serve.
on_module_loop = pytest.mark.asyncio(loop_scope="module")

FRANCE_QUESTION = "What is the capital of France?"
FRANCE: list[ChatCompletionMessageParam] = [{"role": "user", "content": FRANCE_QUESTION}]
SEA: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me three facts about the sea, one sentence each."}]


WaitUntil = Callable[..., Awaitable[None]]


def sample(name: str, stage: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"stage": stage, **labels}) or 0.0


@dataclass
class Served:
    http_url: str
    grpc_target: str
    thinker: StageBundle
    recipes: dict[str, Recipe]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.http_url}/v1", api_key="unused",
                                  max_retries=0, timeout=120)

    def thinker_idle(self) -> bool:
        return all(e.num_running == 0 and e.num_waiting == 0 for e in self.thinker.engines)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[Served]:
    """Thinker, Piper talker and codec stages, and a gateway with a chat recipe that speaks
    through the speech recipe (one per module: building the stages takes seconds)."""
    folders = {"thinker": ensure_smollm2(), "talker": resolve_model("builtin:piper-joe")}
    folders["codec"] = folders["talker"]
    running: dict[str, tuple[StageBundle, RunningServer]] = {}
    for name, folder in folders.items():
        bundle = build_stage(name, Path(folder), {"max_running": 4})
        running[name] = (bundle, await start_stage(bundle))

    def endpoint(name: str) -> StageEndpoint:
        return StageEndpoint(name, f"127.0.0.1:{running[name][1].port}")

    recipes = {
        "smollm2": Recipe(name="smollm2", task=Task.CHAT, model=str(folders["thinker"]),
                          stages={"thinker": endpoint("thinker")}, speech="piper"),
        "piper": Recipe(name="piper", task=Task.TEXT_TO_SPEECH, model=str(folders["talker"]),
                        stages={"talker": endpoint("talker"), "codec": endpoint("codec")}),
    }
    config = GatewayConfig(http_port=free_port(), grpc_port=free_port())
    ready, stop = asyncio.Event(), asyncio.Event()
    gateway = asyncio.create_task(run_gateway(recipes, config, ready, stop))
    await asyncio.wait_for(ready.wait(), 30)
    yield Served(f"http://127.0.0.1:{config.http_port}", f"127.0.0.1:{config.grpc_port}",
                 running["thinker"][0], recipes)
    stop.set()
    await gateway
    for bundle, server in running.values():
        await stop_stage(bundle, server, grace=0.5)


@on_module_loop
async def test_chat_answers_in_text_with_usage(served: Served) -> None:
    completion = await served.client().chat.completions.create(model="smollm2",
                                                               messages=FRANCE)
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == "smollm2"
    assert "Paris" in (choice.message.content or "") and choice.finish_reason == "stop"
    assert choice.message.audio is None
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens > 5 and usage.completion_tokens > 3
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@on_module_loop
async def test_a_streamed_answer_is_the_same_answer_in_chunks(served: Served) -> None:
    client = served.client()
    whole = await client.chat.completions.create(model="smollm2", messages=SEA, max_tokens=16)
    stream = await client.chat.completions.create(
        model="smollm2", messages=SEA, max_tokens=16, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk.id for chunk in chunks}) == 1
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 5  # token by token, not one piece
    assert "".join(texts) == whole.choices[0].message.content  # greedy: the same answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


@on_module_loop
async def test_an_audio_answer_speaks_its_transcript(served: Served) -> None:
    completion = await served.client().chat.completions.create(
        model="smollm2", messages=FRANCE, modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"})
    message = completion.choices[0].message
    assert message.content is None and message.audio is not None  # OpenAI's audio shape
    assert "Paris" in message.audio.transcript and message.audio.expires_at > 0
    audio, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)))
    assert rate == 22_050 and len(audio) > rate // 2 and np.abs(audio).max() > 0.05


@on_module_loop
async def test_streamed_speech_starts_before_the_text_ends(served: Served) -> None:
    stream = await served.client().chat.completions.create(
        model="smollm2", messages=SEA, max_tokens=40, stream=True,
        modalities=["text", "audio"], audio={"voice": "default", "format": "pcm16"})
    kinds: list[str] = []
    pcm = b""
    async for chunk in stream:
        audio = chunk.choices[0].delta.audio if chunk.choices else None
        if audio is not None and audio.transcript:
            kinds.append("text")
        if audio is not None and audio.data:
            kinds.append("audio")
            pcm += base64.b64decode(audio.data)
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert kinds.index("audio") < last_text, kinds
    assert len(pcm) > 22_050  # raw int16 samples: more than half a second


@on_module_loop
async def test_a_client_that_leaves_stops_the_thinker(served: Served,
                                                      wait_until: WaitUntil) -> None:
    aborted = sample("stagemesh_requests_finished_total", "thinker", status="aborted")
    body = {"model": "smollm2", "messages": SEA, "max_tokens": 400, "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "default", "format": "pcm16"}}
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", f"{served.http_url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if '"transcript"' in line:
                break  # the thinker is writing: leave
    await wait_until(lambda: sample("stagemesh_requests_finished_total", "thinker",
                                    status="aborted") == aborted + 1,
                     timeout=30, what="the thinker's abort")
    await wait_until(served.thinker_idle, timeout=10, what="an idle thinker")


@on_module_loop
async def test_grpc_chat_streams_text_audio_and_the_result(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        request = pb.ChatRequest(
            model="smollm2", request_id="grpc-chat-1", audio=pb.ChatAudioOutput(format="wav"),
            messages=[thinker_service_pb2.ChatMessage(role="user", content=FRANCE_QUESTION)])
        events = [event async for event in stub.Chat(request, timeout=120)]
    kinds = [event.WhichOneof("event") for event in events]
    assert kinds[-1] == "result" and {"text", "audio"} <= set(kinds)
    assert all(event.request_id == "grpc-chat-1" for event in events)
    assert "Paris" in "".join(event.text for event in events)
    wav = b"".join(event.audio.data for event in events if event.WhichOneof("event") == "audio")
    assert wav[:4] == b"RIFF" and len(wav) > 44 + 22_050
    assert events[-1].result.finish_reason == "stop" and events[-1].result.completion_tokens > 3


@on_module_loop
async def test_native_rest_chat_streams_ndjson(served: Served) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(f"{served.http_url}/v1/chat:complete", json={
            "model": "smollm2", "max_tokens": 8,
            "messages": [{"role": "user", "content": FRANCE_QUESTION}]})
    assert response.status_code == 200
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert "Paris" in "".join(line.get("text", "") for line in lines)
    assert lines[-1]["result"]["completion_tokens"] == 8


@on_module_loop
async def test_a_spoken_turn_is_answered_from_its_pause_and_held_until_it_ends(
        served: Served, wait_until: WaitUntil) -> None:
    """Realtime speculation over these stages, the Transcriber's events played by the test:
    an early text whose speech resumes is answered, then dropped without a trace (its thinker
    call aborted, no event, no history); the next one is answered at once, unseen, and when
    the turn ends with that text the held answer is the turn's (no second thinker call)."""
    listen = Recipe(name="listen", task=Task.SPEECH_TO_TEXT, model="unused",
                    stages={"transcriber": StageEndpoint("transcriber", "127.0.0.1:9")})
    events: list[dict[str, Any]] = []

    async def send(event: dict[str, Any], unless: Callable[[], bool] | None) -> bool:
        if unless is not None and unless():
            return False
        events.append(event)
        return True

    def finished(status: str) -> float:
        return sample("stagemesh_requests_finished_total", "thinker", status=status)

    def kinds() -> list[str]:
        return [str(event["type"]) for event in events]

    def gateway_count(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"recipe": "smollm2", **labels}) or 0.0

    counts = {"held": ("stagemesh_realtime_turn_answers_total", {"speculative": "true"}),
              "dropped": ("stagemesh_realtime_speculations_dropped_total", {}),
              "leads": ("stagemesh_realtime_speculation_lead_seconds_count", {})}
    before = {key: gateway_count(name, **labels) for key, (name, labels) in counts.items()}
    aborted, completed = finished("aborted"), finished("completed")
    async with open_gateway({**served.recipes, "listen": listen}) as core:
        session = RealtimeSession(core, core.recipes["smollm2"], "test", send, 10.0)
        session.config = SessionConfig(max_output_tokens=40)
        try:
            await session.speech_started(0)
            await session.early_text("Tell me about the sea")
            await wait_until(lambda: not served.thinker_idle(), what="a held answer")
            await session.early_text("")  # speech resumed: the stage withdrew its text
            await wait_until(lambda: finished("aborted") == aborted + 1
                             and served.thinker_idle(), what="the held answer aborted")
            assert kinds() == ["input_audio_buffer.speech_started"]
            assert session.conversation.items == []

            await session.early_text(FRANCE_QUESTION)
            await wait_until(lambda: finished("completed") == completed + 1, timeout=30,
                             what="the held answer written")
            assert kinds() == ["input_audio_buffer.speech_started"]
            await session.speech_stopped(1800)
            await session.heard(FRANCE_QUESTION)
            await wait_until(lambda: kinds()[-1] == "response.done", timeout=30)
        finally:
            await session.close()
    assert (kinds().index("conversation.item.input_audio_transcription.completed")
            < kinds().index("response.created") < kinds().index("response.output_audio.delta"))
    done = events[-1]["response"]
    assert done["status"] in ("completed", "incomplete"), done
    assert "Paris" in done["output"][0]["content"][0]["transcript"], done
    assert [item.role for item in session.conversation.items] == ["user", "assistant"]
    assert finished("completed") == completed + 1 and finished("aborted") == aborted + 1
    # The gateway's /metrics say so: one turn answered by a held answer, one dropped.
    assert {key: gateway_count(name, **labels) - before[key]
            for key, (name, labels) in counts.items()} == {"held": 1, "dropped": 1, "leads": 1}
