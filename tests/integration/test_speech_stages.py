"""Talker and Codec as real gRPC servers on loopback, composed by the gateway's speech path."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile
from prometheus_client import REGISTRY

from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.events import Output
from stagemesh.gateway.mesh import Mesh
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.gateway.speech import AudioPiece, synthesize, validate_speech_params
from stagemesh.models.speech import ensure_speech_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import codec_service_pb2 as pb
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.stage_runtime import start_stage, stop_stage

pytestmark = pytest.mark.timeout(180)

SAMPLES_PER_FRAME = 1920  # Mimi: 24 kHz / 12.5 Hz


def sample(name: str, stage: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"stage": stage, **labels}) or 0.0


@pytest.fixture(scope="module")
def speech_model_dir() -> Path:
    return ensure_speech_model()


@pytest.fixture
async def mesh(speech_model_dir: Path) -> AsyncIterator[Mesh]:
    running = []
    for name in ("talker", "codec"):
        bundle = build_stage(name, speech_model_dir, {"max_running": 4})
        running.append((name, bundle, await start_stage(bundle)))
    recipe = Recipe(name="speech", task=Task.TEXT_TO_SPEECH, model=str(speech_model_dir),
                    stages={name: StageEndpoint(name, f"127.0.0.1:{server.port}")
                            for name, _, server in running})
    mesh = Mesh({"speech": recipe})
    await mesh.start()
    yield mesh
    await mesh.close()
    for _, bundle, server in running:
        await stop_stage(bundle, server, grace=0.5)


def params(mesh: Mesh, **fields: object):  # type: ignore[no-untyped-def]
    recipe = mesh.recipes["speech"]
    return recipe, validate_speech_params(recipe, **{"input": "Hello there.", "voice": "vivian",
                                                     "seed": 3, **fields})


async def run(mesh: Mesh, on_piece=None, request_id: str | None = None,  # type: ignore[no-untyped-def]
              **fields: object) -> list[AudioPiece]:
    recipe, p = params(mesh, **fields)
    pieces: list[AudioPiece] = []

    async def emit(item: object) -> None:
        if isinstance(item, Output):
            pieces.append(item.value)
            if on_piece is not None:
                await on_piece(item.value)

    async with mesh.request_scope(recipe, request_id, 60) as scope:
        await synthesize(recipe, p, scope, mesh.stubs(recipe), emit)
    return pieces


async def test_audio_reaches_the_client_while_the_talker_is_still_generating(mesh: Mesh) -> None:
    frames = 40
    talker_steps_at_start = sample("stagemesh_steps_total", "talker")
    seen: list[float] = []

    async def on_piece(piece: AudioPiece) -> None:
        seen.append(sample("stagemesh_steps_total", "talker") - talker_steps_at_start)

    pieces = await run(mesh, on_piece, max_new_tokens=frames)
    # The first chunk (initial_chunk_frames=5) left long before the 40th frame was generated.
    assert seen[0] < frames / 2
    assert len(pieces) > 2 and {p.sample_rate for p in pieces} == {24_000}
    audio = np.concatenate([p.pcm for p in pieces])
    assert audio.dtype == np.float32 and audio.shape == (frames * SAMPLES_PER_FRAME,)
    assert np.abs(audio).max() > 0


async def test_the_same_seed_gives_the_same_audio(mesh: Mesh) -> None:
    first = np.concatenate([p.pcm for p in await run(mesh, max_new_tokens=8)])
    again = np.concatenate([p.pcm for p in await run(mesh, max_new_tokens=8)])
    np.testing.assert_allclose(first, again, atol=1e-5)


async def test_the_audio_follows_the_talkers_frames(mesh: Mesh) -> None:
    first = np.concatenate([p.pcm for p in await run(mesh, max_new_tokens=8)])
    other = np.concatenate([p.pcm for p in await run(mesh, max_new_tokens=8, seed=4)])
    assert not np.allclose(first, other)


async def _wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def _snapshot() -> dict[str, float]:
    return {f"{stage}/{what}": value for stage in ("talker", "codec") for what, value in (
        ("steps", sample("stagemesh_steps_total", stage)),
        ("aborted", sample("stagemesh_requests_finished_total", stage, status="aborted")))}


async def _assert_both_stopped(before: dict[str, float]) -> None:
    await _wait_for(lambda: all(_snapshot()[f"{s}/aborted"] == before[f"{s}/aborted"] + 1
                                for s in ("talker", "codec")))
    stopped = _snapshot()
    await asyncio.sleep(0.5)
    assert _snapshot() == stopped, "a stage kept stepping after the abort"
    assert stopped["talker/steps"] - before["talker/steps"] < 150


async def test_a_gone_client_stops_talker_and_codec(mesh: Mesh) -> None:
    before = _snapshot()
    got_audio = asyncio.Event()

    async def on_piece(piece: AudioPiece) -> None:
        got_audio.set()

    task = asyncio.create_task(run(mesh, on_piece, max_new_tokens=200))
    await asyncio.wait_for(got_audio.wait(), 30)
    task.cancel()  # what until_disconnect does when the HTTP client goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    await _assert_both_stopped(before)
    assert len(await run(mesh, max_new_tokens=5)) >= 1  # the next request is unaffected


async def test_cancel_by_id_stops_talker_and_codec(mesh: Mesh) -> None:
    before = _snapshot()
    got_audio = asyncio.Event()

    async def on_piece(piece: AudioPiece) -> None:
        got_audio.set()

    task = asyncio.create_task(run(mesh, on_piece, request_id="tts-cancel-1",
                                   max_new_tokens=200))
    await asyncio.wait_for(got_audio.wait(), 30)
    outcome = await mesh.cancel("tts-cancel-1")
    assert outcome.stage == "codec" and outcome.step_index >= 1
    with pytest.raises(GatewayError) as raised:
        await task
    assert raised.value.code.name == "CANCELLED"
    await _assert_both_stopped(before)


async def test_voice_clone_encodes_the_reference_and_conditions_the_talker(mesh: Mesh) -> None:
    t = np.arange(16_000) / 16_000
    buffer = io.BytesIO()
    soundfile.write(buffer, 0.3 * np.sin(2 * np.pi * 220 * t), 16_000, format="WAV")
    encoded_before = sample("stagemesh_requests_finished_total", "codec-encode",
                            status="completed")
    cloned = await run(mesh, task_type="Base", voice="clone", ref_audio=buffer.getvalue(),
                       ref_text="A reference.", max_new_tokens=6)
    assert sample("stagemesh_requests_finished_total", "codec-encode",
                  status="completed") == encoded_before + 1
    cloned_audio = np.concatenate([p.pcm for p in cloned])
    assert cloned_audio.shape == (6 * SAMPLES_PER_FRAME,)


async def test_a_stage_side_bad_field_is_invalid_argument_naming_it(mesh: Mesh) -> None:
    # The recipe's model folder is known here, but pass no voices: the talker must catch it.
    with pytest.raises(GatewayError) as raised:
        await run(mesh, voice="nobody")
    assert raised.value.code.name == "INVALID_ARGUMENT" and raised.value.field_name == "voice"



async def test_undecodable_streamed_frames_end_the_codec_request_as_invalid(mesh: Mesh) -> None:
    codec = mesh.stubs(mesh.recipes["speech"])("codec")
    call = codec.DecodeAudio(timeout=10)
    await call.write(pb.DecodeAudioRequest(start=pb.DecodeAudioStart(request_id="bad-frames")))
    broken = common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[2, 8], data=b"\x00" * 3)
    await call.write(pb.DecodeAudioRequest(input=pb.DecodeAudioInput(codes=broken)))
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for _ in call:
            pass
    error = parse_rpc_error(failure.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and "bytes" in error.message
