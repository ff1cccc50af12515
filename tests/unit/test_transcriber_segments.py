"""The Transcriber adapter's segmentation, with a fake detector and a fake decoder: when speech
events come, what each decode covers, partial cadence, the 28 s split, the end of input.

The real detector and decoder are tests/model/test_transcriber_adapter.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stagemesh.models.families.whisper import WhisperFolder
from stagemesh.services.transcriber.frontend import VAD_WINDOW, Floats, VadStream
from stagemesh.services.transcriber.whisper_adapter import (
    END_PAD_MS,
    MAX_SEGMENT_SECONDS,
    QUIET_PEAK,
    SPEECH_PAD_MS,
    AudioInput,
    Segment,
    SpeechStarted,
    SpeechStopped,
    TranscribeInput,
    TranscriptEvent,
    WhisperTranscriberAdapter,
    _Decoded,
)
from stagemesh.shared.engine.adapter import EngineRequest

RATE = 16_000
WINDOW_MS = VAD_WINDOW * 1000 // RATE  # 32


class LoudIsSpeech:
    """A detector that hears speech in every window whose mean level is above 0.1."""

    def probabilities(self, stream: VadStream, audio: Floats) -> tuple[Floats, VadStream]:
        level = np.abs(audio.reshape(-1, VAD_WINDOW)).mean(axis=1)
        return (level > 0.1).astype(np.float32), stream


@pytest.fixture
def adapter(monkeypatch: pytest.MonkeyPatch) -> WhisperTranscriberAdapter:
    fake = object.__new__(WhisperTranscriberAdapter)  # no model: its parts are faked below
    fake.folder = WhisperFolder(root=Path("/fake"), tokenizer_file=Path("/fake/t.json"),
                                vad_graph=Path("/fake/vad.onnx"), sample_rate=RATE, n_mels=80,
                                languages=("en",))
    fake.sample_rate, fake.max_seconds = RATE, 600.0
    monkeypatch.setattr(fake, "_vad", LoudIsSpeech(), raising=False)
    monkeypatch.setattr(fake, "_prompt", lambda rule: [])
    monkeypatch.setattr(fake, "_in_flight", [], raising=False)
    # The "text" of a decode is the length of audio it was given, in ms; it is done at once.
    monkeypatch.setattr(fake, "_generate", lambda spans: [
        Done(_Decoded(str(audio.shape[0] * 1000 // RATE), 0.0)) for audio, _ in spans])
    return fake


class Done:
    """A decode already done."""

    def __init__(self, decoded: _Decoded) -> None:
        self.decoded = decoded

    def done(self) -> bool:
        return True

    def result(self) -> _Decoded:
        return self.decoded


def voice(seconds: float) -> Floats:
    return np.full(int(RATE * seconds), 0.5, np.float32)


def silence(seconds: float) -> Floats:
    return np.zeros(int(RATE * seconds), np.float32)


def run(adapter: WhisperTranscriberAdapter, audio: Floats, **rule: Any
        ) -> list[TranscriptEvent]:
    """Feed `audio` in 100 ms chunks, stepping as the engine would; every event, in order."""
    state = adapter.prepare(EngineRequest("fake", TranscribeInput(sample_rate=RATE, **rule)))
    events: list[TranscriptEvent] = []
    pieces = [audio[i : i + RATE // 10] for i in range(0, audio.shape[0], RATE // 10)]
    for i, piece in enumerate(pieces):
        adapter.add_input(state, AudioInput(piece, final=i == len(pieces) - 1))
        while True:
            out = adapter.step([state])[0]
            if out.partial is not None:
                events.append(out.partial)
            if out.finished:
                return events
            if out.waiting_for_input:
                break
    raise AssertionError("no end after the final input")


def test_a_pause_closes_a_segment_which_is_decoded_whole_with_its_padding(
    adapter: WhisperTranscriberAdapter,
) -> None:
    events = run(adapter, np.concatenate([voice(1.0), silence(1.0), voice(2.0), silence(1.0)]),
                 partial_interval_ms=-1)
    assert events == [
        SpeechStarted(0), SpeechStopped(1024),  # the first silent window starts at 1024 ms
        Segment(0, str(1024 + END_PAD_MS), 0, 1024 + END_PAD_MS, True, 0.0),
        SpeechStarted(1984), SpeechStopped(4000),  # 1984: the window holding 2000
        Segment(1, str(4000 + END_PAD_MS - (1984 - SPEECH_PAD_MS)), 1984 - SPEECH_PAD_MS,
                4000 + END_PAD_MS, True, 0.0),
    ]


def test_partials_of_an_open_segment_come_every_interval_then_its_final(
    adapter: WhisperTranscriberAdapter,
) -> None:
    events = run(adapter, np.concatenate([voice(3.5), silence(1.0)]), partial_interval_ms=1000)
    partials = [e for e in events if isinstance(e, Segment) and not e.final]
    assert [p.index for p in partials] == [0, 0, 0]
    # Each covers the segment so far, about a second more than the one before.
    assert [round(p.end_ms / 1000) for p in partials] == [1, 2, 3]
    assert all(p.start_ms == 0 for p in partials)
    assert isinstance(events[-1], Segment) and events[-1].final and events[-1].index == 0
    assert events.index(SpeechStopped(3520)) == len(events) - 2


def test_a_long_segment_is_cut_before_whispers_window_without_a_speech_stop(
    adapter: WhisperTranscriberAdapter,
) -> None:
    events = run(adapter, voice(60.0), partial_interval_ms=-1)
    finals = [e for e in events if isinstance(e, Segment)]
    assert all(s.end_ms - s.start_ms <= MAX_SEGMENT_SECONDS * 1000 for s in finals)
    assert [s.index for s in finals] == [0, 1, 2]
    assert finals[0].end_ms == finals[1].start_ms and finals[-1].end_ms == 60_000
    # One utterance: one start, and one stop at the end of the input.
    assert [type(e) for e in events if not isinstance(e, Segment)] == [SpeechStarted,
                                                                        SpeechStopped]


def test_without_vad_the_input_is_one_segment_and_no_speech_event(
    adapter: WhisperTranscriberAdapter,
) -> None:
    events = run(adapter, np.concatenate([voice(1.0), silence(2.0), voice(1.0)]), vad=False,
                 partial_interval_ms=-1)
    assert events == [Segment(0, "4000", 0, 4000, True, 0.0)]


def test_silence_is_no_event_and_the_audio_kept_stays_short(
    adapter: WhisperTranscriberAdapter,
) -> None:
    state = adapter.prepare(EngineRequest("quiet", TranscribeInput(sample_rate=RATE)))
    for _ in range(100):  # 10 s of silence
        adapter.add_input(state, AudioInput(silence(0.1)))
        while not (out := adapter.step([state])[0]).waiting_for_input:
            assert out.partial is None
    assert state.heard >= RATE * 9.9
    assert state.audio.shape[0] <= RATE * SPEECH_PAD_MS // 1000 + 2 * VAD_WINDOW


def test_a_pause_decodes_its_segment_early_and_speech_resuming_makes_that_stale(
    adapter: WhisperTranscriberAdapter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded_ms: list[int] = []
    generate = adapter._generate

    def recording(spans: list[tuple[Floats, list[int]]]) -> list[Any]:
        decoded_ms.extend(audio.shape[0] * 1000 // RATE for audio, _ in spans)
        return generate(spans)

    monkeypatch.setattr(adapter, "_generate", recording)
    events = run(adapter, np.concatenate([voice(1.0), silence(0.3), voice(1.0), silence(1.0)]),
                 partial_interval_ms=-1)
    # END_PAD_MS into each pause its segment is decoded as a close there would cut it; the first
    # pause ends too soon (speech resumes), the second closes on exactly the early audio, whose
    # text is the final one: no decode after the close.
    assert decoded_ms == [1024 + END_PAD_MS, 2304 + END_PAD_MS]
    assert events == [SpeechStarted(0), SpeechStopped(2304),
                      Segment(0, str(2304 + END_PAD_MS), 0, 2304 + END_PAD_MS, True, 0.0)]


def test_early_partials_send_a_pauses_text_and_withdraw_it_when_speech_resumes(
    adapter: WhisperTranscriberAdapter,
) -> None:
    events = run(adapter, np.concatenate([voice(1.0), silence(0.3), voice(1.0), silence(1.0)]),
                 partial_interval_ms=-1, early_partials=True)
    # Each pause's early text leaves as a partial at once; the first pause ends too soon, and
    # an empty partial withdraws its text; the second closes on exactly the early audio, so
    # its final text is the partial's.
    texts = [(e.index, e.text, e.final) for e in events if isinstance(e, Segment)]
    assert texts == [(0, str(1024 + END_PAD_MS), False), (0, "", False),
                     (0, str(2304 + END_PAD_MS), False), (0, str(2304 + END_PAD_MS), True)]
    assert events[0] == SpeechStarted(0) and events[-2:-1] == [SpeechStopped(2304)]


class LateDetector(LoudIsSpeech):
    """Hears speech for three windows after the voice ends, as Silero does (its context)."""

    def probabilities(self, stream: VadStream, audio: Floats) -> tuple[Floats, VadStream]:
        loud, _ = super().probabilities(stream, audio)
        held = np.concatenate([self.tail, loud])
        self.tail = held[-3:]
        return np.array([held[i : i + 4].max() for i in range(loud.shape[0])]), stream

    tail = np.zeros(3, np.float32)


def test_a_pause_starts_where_the_voice_went_quiet_not_where_the_detector_noticed(
    adapter: WhisperTranscriberAdapter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(adapter, "_vad", LateDetector())
    quiet = run(adapter, np.concatenate([voice(1.0), silence(1.0)]), partial_interval_ms=-1,
                silence_duration_ms=500)
    # The detector hears silence from 1120 ms (three windows late); those windows are silent,
    # so the pause starts at 1024 ms and 500 ms of it close the segment at 1524 ms.
    assert quiet == [SpeechStarted(0), SpeechStopped(1024),
                     Segment(0, str(1024 + END_PAD_MS), 0, 1024 + END_PAD_MS, True, 0.0)]
    # A tail the detector does not count as speech, but louder than QUIET_PEAK (a murmur,
    # noise): the pause starts where the detector says.
    murmur = np.full(int(RATE * 0.096), 2 * QUIET_PEAK, np.float32)
    monkeypatch.setattr(adapter, "_vad", LateDetector())
    noisy = run(adapter, np.concatenate([voice(1.0), murmur, silence(1.0)]),
                partial_interval_ms=-1, silence_duration_ms=500)
    assert noisy[1] == SpeechStopped(1024 + 96)
