"""The default voice (Piper joe) as real Talker and Codec gRPC servers, composed by the gateway.

Intelligibility is tests/model/test_voice_intelligibility.py; here: the mesh streams it,
reproducibly, publishes its one voice, refuses a clone, and a cancel stops both stages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError, InvalidRequest
from stagemesh.gateway.mesh.events import Output, StageEvent
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.gateway.speech.pipeline import AudioPiece, prepare_speech, synthesize
from stagemesh.gateway.speech.pipeline import voices as speech_voices
from stagemesh.gateway.speech.protocol import SpeechRequest
from stagemesh.models.piper import ensure_piper_model
from stagemesh.services.registry import build_stage
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage

pytest.importorskip("piper", reason="the Piper voice needs the voice-gpl extra")
#: One voice mesh per module (each test leaves it idle), so the tests run on the module's loop.
pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

TWO_SENTENCES = "Hello there, how are you today? The weather is lovely this afternoon."


@dataclass
class Voice:
    core: GatewayCore
    bundles: list[StageBundle]

    def idle(self) -> bool:
        return all(engine.num_running == 0 and engine.num_waiting == 0
                   for bundle in self.bundles for engine in bundle.engines)


@pytest.fixture(scope="module")
def piper_dir() -> Path:
    return ensure_piper_model()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def voice(piper_dir: Path) -> AsyncIterator[Voice]:
    running = []
    for name in ("talker", "codec"):
        bundle = build_stage(name, piper_dir, {"max_running": 4})
        running.append((name, bundle, await start_stage(bundle)))
    recipe = Recipe(name="voice", task=Task.TEXT_TO_SPEECH, model=str(piper_dir),
                    stages={name: StageEndpoint(name, f"127.0.0.1:{server.port}")
                            for name, _, server in running})
    async with open_gateway({"voice": recipe}) as core:
        yield Voice(core, [bundle for _, bundle, _ in running])
    for _, bundle, server in running:
        await stop_stage(bundle, server, grace=0.5)


async def speak(mesh: Voice, started: asyncio.Event | None = None,
                request_id: str | None = None, **fields: Any) -> list[AudioPiece]:
    job = await prepare_speech(mesh.core,
        SpeechRequest(**{"input": TWO_SENTENCES, "seed": 5, **fields}))
    pieces: list[AudioPiece] = []

    async def emit(item: StageEvent | Output[AudioPiece]) -> None:
        if isinstance(item, Output):
            pieces.append(item.value)
            if started is not None:
                started.set()

    await synthesize(mesh.core, job, RequestContext.create(request_id, 60), emit)
    return pieces


def audio(pieces: list[AudioPiece]) -> np.ndarray:
    return np.concatenate([p.pcm for p in pieces])


async def test_the_voice_streams_in_chunks_and_a_seed_reproduces_it(voice: Voice) -> None:
    pieces = await speak(voice)
    assert {p.sample_rate for p in pieces} == {22_050} and len(pieces) > 3
    first = audio(pieces)
    assert 3.0 < first.shape[0] / 22_050 < 8.0  # two short sentences
    assert 0.05 < float(np.abs(first).max()) <= 1.0
    np.testing.assert_array_equal(audio(await speak(voice)), first)
    other = audio(await speak(voice, seed=6))
    assert other.shape != first.shape or not np.allclose(other, first)


async def test_voices_are_what_the_model_has_and_default_selects_it(voice: Voice) -> None:
    recipe, voices = await speech_voices(voice.core, "voice")
    assert voices == ["joe"]
    facts = await voice.core.catalog.speech_facts(recipe)
    assert facts.default_voice == "joe" and not facts.supports_voice_clone
    by_name = audio(await speak(voice, voice="joe", input="Good morning."))
    np.testing.assert_array_equal(audio(await speak(voice, voice="default",
                                                    input="Good morning.")), by_name)
    with pytest.raises(InvalidRequest, match="unknown voice 'vivian'"):
        await prepare_speech(voice.core, SpeechRequest(input="Hi.", voice="vivian"))


async def test_a_voice_clone_is_refused_saying_the_model_cannot_clone(voice: Voice) -> None:
    with pytest.raises(InvalidRequest, match="cannot clone") as raised:
        await prepare_speech(voice.core, SpeechRequest(
            input="Hi.", task_type="Base", voice="clone", ref_audio=b"RIFF"))
    assert raised.value.field_name == "task_type"


async def test_cancel_by_id_stops_talker_and_codec_between_chunks(voice: Voice,
                                                                  wait_until: Any) -> None:
    long_text = " ".join(f"This is sentence number {n}, spoken slowly." for n in range(12))
    started = asyncio.Event()
    task = asyncio.create_task(speak(voice, started, request_id="piper-cancel-1",
                                     input=long_text))
    await asyncio.wait_for(started.wait(), 60)
    outcome = await voice.core.cancel("piper-cancel-1")
    assert outcome.step_index >= 1
    with pytest.raises(GatewayError) as raised:
        await task
    assert raised.value.code.name == "CANCELLED"
    await wait_until(voice.idle, what="talker and codec holding no request")
    # The next request is served as usual.
    assert len(await speak(voice, input="Still here.")) >= 1
