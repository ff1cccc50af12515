"""Transcriber stage adapter: streamed audio -> speech events and transcript segments, with
Whisper on CTranslate2 and Silero VAD on ONNX Runtime (`stagemesh.models.families.whisper`).

Streaming is VAD-segmented: the detector classifies each 32 ms window as it arrives; a pause of
`silence_duration_ms` closes the voiced segment, which is then decoded once, whole (Whisper
hears a whole utterance, so the final text is as good as an offline pass over it). While a
segment is still open, a partial transcript of what it holds so far is decoded every
`partial_interval_ms` of audio, so text arrives while the speaker still speaks. A segment that
reaches MAX_SEGMENT_SECONDS is closed where it is (Whisper hears 30 s at most). Without VAD the
audio is one segment, split the same way, closed at the end of the input.

One step does one thing for a state, in this order: send its next queued event; decode its
next closed segment (one decode pass, batched across the states that decode in this step);
classify the audio that arrived (one detector call); decode a partial; close the segment at
the end of the input. A cancel therefore lands after at most one decode pass.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ctranslate2  # type: ignore[import-untyped]  # ships no type information
import numpy as np
import tokenizers
import torch

from stagemesh.models.families.whisper import WhisperFolder
from stagemesh.services.transcriber.frontend import (
    VAD_WINDOW,
    SileroVad,
    VadStream,
    log_mel,
)
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StageAdapter,
    StepOutput,
)
from stagemesh.shared.resample import Floats, StreamResampler

log = logging.getLogger(__name__)

#: Input sample rates the stage takes (resampled to the model's): telephony, the model's own,
#: Piper voices, the OpenAI realtime route, CD and studio rates.
SAMPLE_RATES = (8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
#: Longest audio one input message may carry.
MAX_CHUNK_SECONDS = 10.0
#: A segment is closed at this length (Whisper decodes 30 s windows; the rest is padding).
MAX_SEGMENT_SECONDS = 28.0
#: Audio kept before a segment's first voiced window and after its last: Silero answers a
#: window late, and Whisper misses clipped word edges.
SPEECH_PAD_MS = 200
#: A partial needs this much of an open segment: shorter, Whisper mostly guesses.
MIN_PARTIAL_MS = 500
#: The detector's probability must fall this far below the threshold to count as silence
#: (hysteresis, as Silero's own segmentation).
VAD_HYSTERESIS = 0.15
#: Most windows one detector call classifies, so that a step stays short (10 s of audio).
MAX_VAD_WINDOWS = 312
#: Whisper's context holds 448 tokens; the prompt may take up to half of them, less one.
MAX_PROMPT_TOKENS = 223
#: Option defaults.
DEFAULT_SILENCE_MS = 500
DEFAULT_VAD_THRESHOLD = 0.5
DEFAULT_PARTIAL_MS = 1000
DEFAULT_MAX_SECONDS = 600.0


@dataclass(frozen=True)
class TranscribeInput:
    """Starts a transcription of mono audio at `sample_rate`."""

    sample_rate: int
    language: str = ""  # "" = the model's first language
    prompt: str = ""
    vad: bool = True
    silence_duration_ms: int = DEFAULT_SILENCE_MS
    vad_threshold: float = DEFAULT_VAD_THRESHOLD
    partial_interval_ms: int = DEFAULT_PARTIAL_MS  # <= 0: no partials


@dataclass(frozen=True)
class AudioInput:
    """More float32 samples at the start's rate (possibly none, with final=True)."""

    samples: Floats
    final: bool = False


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int


@dataclass(frozen=True)
class Segment:
    """A transcript: partial (of a segment still open) or final (of a closed one)."""

    index: int
    text: str
    start_ms: int
    end_ms: int
    final: bool
    no_speech_prob: float


#: What the stage streams out, in the order of the audio.
TranscriptEvent = SpeechStarted | SpeechStopped | Segment


@dataclass(frozen=True)
class TranscribeResult:
    text: str  # the final segments' texts joined by spaces
    audio_ms: int  # input received
    segments: int
    decode_seconds: float


@dataclass(frozen=True)
class _Span:
    """A closed segment to decode: model-rate sample indices [start, end)."""

    start: int
    end: int


@dataclass
class TranscribeState:
    request_id: str
    rule: TranscribeInput
    resampler: StreamResampler
    prompt_ids: list[int]
    vad: VadStream = field(default_factory=VadStream)
    audio: Floats = field(default_factory=lambda: np.zeros(0, np.float32))  # from `base` on
    base: int = 0  # model-rate index of audio[0]
    heard: int = 0  # model-rate samples the detector has classified
    received: int = 0  # input-rate samples received
    final: bool = False
    speech_start: int | None = None  # the open segment's first sample (padded)
    silence_since: int | None = None  # where the current pause in it began
    closed_end: int = 0  # where the last closed segment ended
    last_partial: int = 0  # `heard` when the last partial was decoded
    queue: collections.deque[TranscriptEvent | _Span] = field(
        default_factory=collections.deque)
    texts: list[str] = field(default_factory=list)
    steps: int = 0
    decode_seconds: float = 0.0

    @property
    def available(self) -> int:
        """Model-rate samples received so far."""
        return self.base + int(self.audio.shape[0])


class _Work(enum.Enum):
    """What one step does for one state (see the module docstring for the order)."""

    EMIT = enum.auto()
    DECODE = enum.auto()  # the queued span at the head, final
    LISTEN = enum.auto()
    PARTIAL = enum.auto()
    CLOSE = enum.auto()
    WAIT = enum.auto()
    DONE = enum.auto()


@dataclass(frozen=True)
class _Decoded:
    text: str
    no_speech_prob: float


class WhisperTranscriberAdapter:
    """The Transcriber stage's model: Silero VAD + Whisper (CTranslate2), step by step."""

    stage = "transcriber"

    def __init__(self, model_dir: str | Path, *, threads: int = 1,
                 max_seconds: float = DEFAULT_MAX_SECONDS, device: torch.device | None = None,
                 dtype: str = "float32") -> None:
        device = device or torch.device("cpu")
        self.folder = WhisperFolder.load(model_dir)
        self.sample_rate = self.folder.sample_rate
        self.max_seconds = max_seconds
        # int8 weights, activations in the stage's dtype (CTranslate2's `int8_<dtype>`).
        self.compute_type = f"int8_{dtype}"
        self._model = ctranslate2.models.Whisper(
            str(self.folder.root), device=device.type, device_index=device.index or 0,
            compute_type=self.compute_type, intra_threads=threads)
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self.folder.tokenizer_file))
        self._vad = SileroVad(self.folder.vad_graph)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: TranscribeInput) -> None:
        if payload.sample_rate not in SAMPLE_RATES:
            raise InvalidInputError("sample_rate", f"sample_rate must be one of {SAMPLE_RATES}, "
                                    f"got {payload.sample_rate}")
        if payload.language and payload.language not in self.folder.languages:
            raise InvalidInputError("language", f"language must be one of "
                                    f"{list(self.folder.languages)}, got {payload.language!r}")
        if not 0.0 < payload.vad_threshold < 1.0:
            raise InvalidInputError("vad_threshold", f"vad_threshold must be in (0, 1), got "
                                    f"{payload.vad_threshold}")
        if not 0 < payload.silence_duration_ms <= 10_000:
            raise InvalidInputError("silence_duration_ms", f"silence_duration_ms must be in "
                                    f"1..10000, got {payload.silence_duration_ms}")

    # -- engine contract ----------------------------------------------------------------------

    def prepare(self, request: EngineRequest[TranscribeInput]) -> TranscribeState:
        rule = request.payload
        state = TranscribeState(
            request_id=request.request_id, rule=rule, prompt_ids=self._prompt(rule),
            resampler=StreamResampler(rule.sample_rate, self.sample_rate))
        if not rule.vad:
            state.speech_start = 0  # one segment from the start, split by length only
        return state

    def add_input(self, state: TranscribeState, payload: AudioInput) -> None:
        if state.final:
            raise InvalidInputError("input", "audio arrived after the final input")
        rate, samples = state.rule.sample_rate, payload.samples.shape[0]
        if samples > MAX_CHUNK_SECONDS * rate:
            raise InvalidInputError("input.pcm", f"one input carries at most "
                                    f"{MAX_CHUNK_SECONDS:g} s ({int(MAX_CHUNK_SECONDS * rate)} "
                                    f"samples at {rate} Hz), got {samples}")
        limit = int(self.max_seconds * rate)
        if state.received + payload.samples.shape[0] > limit:
            raise InvalidInputError("input.pcm", f"more than {self.max_seconds:g} s of audio "
                                    f"({limit} samples at {state.rule.sample_rate} Hz)")
        state.received += payload.samples.shape[0]
        audio = state.resampler.push(payload.samples.astype(np.float32, copy=False),
                                     final=payload.final)
        if payload.final:  # the detector classifies whole windows: pad the last one
            audio = np.concatenate([audio, np.zeros(-(state.available + audio.shape[0])
                                                    % VAD_WINDOW, np.float32)])
            state.final = True
        state.audio = np.concatenate([state.audio, audio])

    def step(self, states: Sequence[TranscribeState]) -> list[StepOutput[TranscriptEvent]]:
        work = [self._plan(state) for state in states]
        # The fallible work first (detector and decoder), states untouched until it is done.
        decoding = [(s, w) for s, w in zip(states, work, strict=True)
                    if w in (_Work.DECODE, _Work.PARTIAL)]
        started = time.perf_counter()
        spans = [(self._span(s, w), s.prompt_ids) for s, w in decoding]
        decoded = self._decode(spans) if spans else []
        seconds = (time.perf_counter() - started) / max(len(decoding), 1)
        heard = {id(s): self._listen(s) for s, w in zip(states, work, strict=True)
                 if w is _Work.LISTEN}  # (probabilities, the detector's next state)
        by_state = {id(s): d for (s, _), d in zip(decoding, decoded, strict=True)}
        outputs = []
        for state, what in zip(states, work, strict=True):
            if id(state) in by_state:
                state.decode_seconds += seconds
            outputs.append(self._apply(state, what, by_state.get(id(state)),
                                       heard.get(id(state))))
        return outputs

    def finish(self, state: TranscribeState) -> TranscribeResult:
        return TranscribeResult(
            text=" ".join(text for text in state.texts if text),
            audio_ms=round(1000 * state.received / state.rule.sample_rate),
            segments=len(state.texts), decode_seconds=state.decode_seconds)

    def release(self, state: TranscribeState) -> None:
        state.audio = np.zeros(0, np.float32)
        state.queue.clear()

    def batch_key(self, state: TranscribeState) -> Hashable:
        return self.stage

    # -- planning and applying one step -------------------------------------------------------

    def _plan(self, state: TranscribeState) -> _Work:
        if state.queue:
            return _Work.EMIT if not isinstance(state.queue[0], _Span) else _Work.DECODE
        if state.available - state.heard >= VAD_WINDOW:
            return _Work.LISTEN
        if self._partial_due(state):
            return _Work.PARTIAL
        if state.final:
            return _Work.CLOSE if state.speech_start is not None else _Work.DONE
        return _Work.WAIT

    def _partial_due(self, state: TranscribeState) -> bool:
        interval = state.rule.partial_interval_ms
        if state.speech_start is None or interval <= 0 or state.final:
            return False
        return (state.heard - state.last_partial >= self._samples(interval)
                and state.heard - state.speech_start >= self._samples(MIN_PARTIAL_MS))

    def _span(self, state: TranscribeState, work: _Work) -> Floats:
        if work is _Work.DECODE:
            span = state.queue[0]
            assert isinstance(span, _Span)
            start, end = span.start, span.end
        else:
            assert state.speech_start is not None
            start, end = state.speech_start, state.heard
        return state.audio[start - state.base : end - state.base]

    def _apply(self, state: TranscribeState, work: _Work, decoded: _Decoded | None,
               heard: tuple[Floats, VadStream] | None) -> StepOutput[TranscriptEvent]:
        if work is _Work.WAIT:
            return StepOutput(step_index=state.steps, waiting_for_input=True)
        if work is _Work.DONE:
            return StepOutput(step_index=state.steps, finished=True)
        state.steps += 1
        event: TranscriptEvent | None = None
        if work is _Work.DECODE and decoded is not None:
            span = state.queue.popleft()
            assert isinstance(span, _Span)
            event = self._segment(state, len(state.texts), span.start, span.end, decoded, True)
            state.texts.append(decoded.text)
        elif work is _Work.PARTIAL and decoded is not None:
            assert state.speech_start is not None
            event = self._segment(state, len(state.texts) + _queued_spans(state),
                                  state.speech_start, state.heard, decoded, False)
            state.last_partial = state.heard
        elif work is _Work.LISTEN and heard is not None:
            state.vad = heard[1]
            self._segment_speech(state, heard[0])
        elif work is _Work.CLOSE:
            self._close(state, state.heard, stopped=state.rule.vad)
        if event is None and state.queue and not isinstance(state.queue[0], _Span):
            item = state.queue.popleft()  # an event the work just queued, or one waiting
            assert not isinstance(item, _Span)
            event = item
        self._trim(state)
        return StepOutput(step_index=state.steps, partial=event)

    # -- voice activity -----------------------------------------------------------------------

    def _listen(self, state: TranscribeState) -> tuple[Floats, VadStream]:
        """The speech probabilities of the windows that arrived, and the detector's state
        after them (the state's own is not touched)."""
        windows = min((state.available - state.heard) // VAD_WINDOW, MAX_VAD_WINDOWS)
        audio = state.audio[state.heard - state.base :][: windows * VAD_WINDOW]
        if not state.rule.vad:  # nothing to classify: every window counts as voiced
            return np.ones(windows, np.float32), state.vad
        return self._vad.probabilities(state.vad, audio)

    def _segment_speech(self, state: TranscribeState, probs: Floats) -> None:
        """Walk the windows' probabilities: open, close and split segments, queue events."""
        rule, pad = state.rule, self._samples(SPEECH_PAD_MS)
        silence, longest = self._samples(rule.silence_duration_ms), self._samples(
            int(MAX_SEGMENT_SECONDS * 1000))
        for prob in probs:
            at = state.heard
            state.heard += VAD_WINDOW
            if state.speech_start is None:
                if prob >= rule.vad_threshold:
                    state.speech_start = max(state.closed_end, at - pad)
                    state.last_partial = state.heard
                    state.queue.append(SpeechStarted(self._ms(at)))
                continue
            if prob >= rule.vad_threshold:
                state.silence_since = None
            elif prob < rule.vad_threshold - VAD_HYSTERESIS and state.silence_since is None:
                state.silence_since = at
            if state.silence_since is not None and state.heard - state.silence_since >= silence:
                self._close(state, state.silence_since, stopped=True)
            elif state.heard - state.speech_start >= longest:  # too long for one window
                state.queue.append(_Span(state.speech_start, state.heard))
                state.speech_start = state.last_partial = state.heard

    def _close(self, state: TranscribeState, speech_end: int, stopped: bool) -> None:
        """Close the open segment where its speech ended; queue SpeechStopped and its decode."""
        assert state.speech_start is not None
        end = min(speech_end + self._samples(SPEECH_PAD_MS), state.heard)
        if stopped:
            state.queue.append(SpeechStopped(self._ms(speech_end)))
        if end > state.speech_start:
            state.queue.append(_Span(state.speech_start, end))
        state.closed_end = end
        state.speech_start = state.silence_since = None

    def _trim(self, state: TranscribeState) -> None:
        """Drop the audio nothing will decode again."""
        keep = [state.heard - self._samples(SPEECH_PAD_MS)]
        keep += [s.start for s in state.queue if isinstance(s, _Span)]
        if state.speech_start is not None:
            keep.append(state.speech_start)
        keep_from = max(state.base, min(keep))
        state.audio = state.audio[keep_from - state.base :]
        state.base = keep_from

    # -- the decoder ----------------------------------------------------------------------------

    def _prompt(self, rule: TranscribeInput) -> list[int]:
        """Whisper's decoder prompt: the caller's text as previous context, then the start of
        a transcript without timestamps (in the language, for a multilingual model)."""
        ids: list[int] = []
        if rule.prompt.strip():
            text = self._tokenizer.encode(" " + rule.prompt.strip(), add_special_tokens=False)
            ids = [self._token("<|startofprev|>"), *text.ids[-MAX_PROMPT_TOKENS:]]
        ids.append(self._token("<|startoftranscript|>"))
        if self.folder.multilingual:
            language = rule.language or self.folder.languages[0]
            ids += [self._token(f"<|{language}|>"), self._token("<|transcribe|>")]
        return [*ids, self._token("<|notimestamps|>")]

    def _token(self, text: str) -> int:
        token = self._tokenizer.token_to_id(text)
        if token is None:
            raise ValueError(f"{self.folder.tokenizer_file} has no token {text}")
        return int(token)

    def _decode(self, spans: list[tuple[Floats, list[int]]]) -> list[_Decoded]:
        """One greedy decode pass over a batch of (audio, prompt)."""
        features = np.stack([log_mel(audio, self.folder.n_mels) for audio, _ in spans])
        results = self._model.generate(
            ctranslate2.StorageView.from_array(features), [prompt for _, prompt in spans],
            beam_size=1, return_no_speech_prob=True)
        return [_Decoded(self._tokenizer.decode(r.sequences_ids[0]).strip(),
                         float(r.no_speech_prob)) for r in results]

    def _segment(self, state: TranscribeState, index: int, start: int, end: int,
                 decoded: _Decoded, final: bool) -> Segment:
        return Segment(index=index, text=decoded.text, start_ms=self._ms(start),
                       end_ms=self._ms(end), final=final, no_speech_prob=decoded.no_speech_prob)

    def _samples(self, ms: int) -> int:
        return ms * self.sample_rate // 1000

    def _ms(self, samples: int) -> int:
        return samples * 1000 // self.sample_rate


def _queued_spans(state: TranscribeState) -> int:
    return sum(isinstance(item, _Span) for item in state.queue)


#: The static proof that the adapter is the Transcriber stage's StageAdapter.
_: type[StageAdapter[TranscribeInput, AudioInput, TranscribeState, TranscriptEvent,
                     TranscribeResult]] = WhisperTranscriberAdapter
