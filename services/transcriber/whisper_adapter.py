"""Transcriber stage adapter: streamed audio -> speech events and transcript segments, with
Whisper on CTranslate2 and Silero VAD on ONNX Runtime (`stagemesh.models.families.whisper`).

Streaming is VAD-segmented: the detector classifies each 32 ms window as it arrives; a pause of
`silence_duration_ms` closes the voiced segment, which is then decoded once, whole (Whisper
hears a whole utterance, so the final text is as good as an offline pass over it). While a
segment is still open, a partial transcript of what it holds so far is decoded every
`partial_interval_ms` of audio, so text arrives while the speaker still speaks. A segment that
reaches MAX_SEGMENT_SECONDS is closed where it is (Whisper hears 30 s at most). Without VAD the
audio is one segment, split the same way, closed at the end of the input.

The ears never wait for the decoder: a decode pass runs on CTranslate2's own thread
(`asynchronous=True`) while the steps go on classifying the audio that arrives, so a speech
start or stop is sent the step after the window that decided it, not after a decode (a
realtime client's turn ends, and its barge-in is heard, that much sooner). Decodes are also
started early: once a pause in a segment reaches END_PAD_MS, the segment as it would be
closed there is decoded ("early"); when the pause then lasts `silence_duration_ms`, the
segment closes on exactly that audio and the early text is its final text (the same samples
and prompt: the same greedy decode), often ready as the stop is sent. Speech resuming makes it
stale, and it is dropped. With `early_partials`, the early text is also sent at once as a
partial of the open segment (an empty partial withdraws it if speech resumes): a caller can
start on the likely end of a turn before the pause has lasted. A state has at most one decode
in flight; a decode cannot be stopped part-way, so a cancelled state's last decode finishes
unseen.

One step, for each state: take its decode if it finished; classify the whole windows that
arrived (one detector call) and queue the speech events and closed segments they decide;
start its next decode (the oldest closed segment, else an early or a partial one); close the
segment at the end of the input; send its next event. Events leave in the audio's order: a
segment's final text after its stop, before anything later. A cancel lands at the next step.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ctranslate2  # type: ignore[import-untyped]  # ships no type information
import numpy as np
import tokenizers
import torch

from stagemesh.models.families.whisper import WhisperFolder
from stagemesh.services.transcriber.frontend import (
    VAD_WINDOW,
    WINDOW_SECONDS,
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
#: Audio kept before a segment's first voiced window: Silero answers a window late, and
#: Whisper misses clipped word edges.
SPEECH_PAD_MS = 200
#: Audio kept after a segment's pause starts (the close's cut, and when the early decode of a
#: pause can start): the pause starts where the voice went quiet (QUIET_PEAK), so this is
#: silence already, which Whisper's own padding follows anyway.
END_PAD_MS = 100
#: Silero's probability stays high for 1-4 windows after a voice ends (its context and
#: state): the windows just before the one that starts a pause are counted in the pause when
#: every sample of theirs stays below this (-40 dBFS), up to MAX_QUIET_LOOKBACK_MS. So the
#: pause starts within a window of the last voiced sample, and `silence_duration_ms` of
#: silence ends the turn about when it has passed, not 70-150 ms later.
QUIET_PEAK = 0.01
MAX_QUIET_LOOKBACK_MS = 192
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
#: A step with nothing to do but wait for decodes in flight sleeps this long (rather than spin
#: the engine's loop): the most a finished decode waits to be seen.
DECODE_POLL_SECONDS = 0.005
#: The windows a decode may hear, shortest first, and the padding its audio leaves in one at
#: least. Whisper was trained on 30 s windows, mostly padding for a spoken turn, and its
#: encoder's cost grows with its input: a short turn decodes ~4x faster in a 10 s window, with
#: the same text on our voice (bench questions, the six test sentences, 5-11 s runs of them);
#: with less than ~5 s of padding (4-8 s windows for a 2-3 s turn, a 5.2 s run in 10 s) it
#: sometimes repeats its text until `max_length`, so a decode keeps 5.5 s of padding.
DECODE_WINDOWS_SECONDS = (10, 20, WINDOW_SECONDS)
DECODE_PAD_SECONDS = 5.5


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
    #: Send a pause's early text as a partial of its open segment (withdrawn by an empty
    #: partial if speech resumes), whatever `partial_interval_ms` says: a caller may start
    #: on it before the turn ends (the realtime route's speculation).
    early_partials: bool = False


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
    """A segment to decode: model-rate sample indices [start, end)."""

    start: int
    end: int


@dataclass(frozen=True)
class _Decoded:
    text: str
    no_speech_prob: float


class _Kind(enum.Enum):
    """What a decode is for (see the module docstring)."""

    FINAL = enum.auto()  # the oldest closed segment
    EARLY = enum.auto()  # the open segment as a pause would close it
    PARTIAL = enum.auto()  # the open segment so far


class _Job(Protocol):
    """A decode started: done yet, and its text once done."""

    def done(self) -> bool: ...

    def result(self) -> _Decoded: ...


@dataclass
class _Whispered:
    """One example of a decode pass running on CTranslate2's thread."""

    running: Any  # ctranslate2's WhisperGenerationResultAsync
    tokenizer: tokenizers.Tokenizer
    features: Floats  # the batch's log-mel input: CTranslate2 reads it until the pass is done

    def done(self) -> bool:
        return bool(self.running.done())

    def result(self) -> _Decoded:
        result = self.running.result()
        return _Decoded(self.tokenizer.decode(result.sequences_ids[0]).strip(),
                        float(result.no_speech_prob))


@dataclass
class _Decode:
    """One state's decode in flight."""

    kind: _Kind
    span: _Span
    job: _Job
    submitted: float  # time.perf_counter()
    batch: int  # states decoded in the same pass
    decoded: _Decoded | None = None  # once collected


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
    last_partial: int = 0  # `heard` when the last partial was started
    #: Events to send and closed segments to decode, in the audio's order.
    queue: collections.deque[TranscriptEvent | _Span] = field(
        default_factory=collections.deque)
    decoding: _Decode | None = None
    early: tuple[_Span, _Decoded] | None = None  # the last early decode's span and text
    early_end: int | None = None  # the span end of the last early decode started
    early_sent: bool = False  # the open segment's early text was sent as a partial
    texts: list[str] = field(default_factory=list)
    steps: int = 0
    decode_seconds: float = 0.0

    @property
    def available(self) -> int:
        """Model-rate samples received so far."""
        return self.base + int(self.audio.shape[0])

    def unheard_windows(self) -> int:
        return (self.available - self.heard) // VAD_WINDOW

    def first_span(self) -> tuple[int, _Span] | None:
        """The oldest closed segment not yet decoded, with its place in the queue."""
        return next(((i, item) for i, item in enumerate(self.queue)
                     if isinstance(item, _Span)), None)


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
        # The mel filters' first use imports their builder (seconds): at start, not in the
        # first turn's decode, where it stalled the steps that listen.
        log_mel(np.zeros(VAD_WINDOW, np.float32), self.folder.n_mels)
        #: Every decode not yet done, a released state's too (its features must stay alive).
        self._in_flight: list[_Decode] = []

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
        self._in_flight = [d for d in self._in_flight if not d.job.done()]
        # The fallible work first (decoder results, detector, new decodes), states untouched
        # until it is done; starting the decodes comes last, so a failure starts none.
        done = {id(s): self._collect(s.decoding) for s in states
                if s.decoding is not None and s.decoding.job.done()}
        heard = {id(s): self._listen(s) for s in states if s.unheard_windows()}
        wanted = [(s, plan) for s in states if s.decoding is None
                  and (plan := self._next_decode(s)) is not None]
        started = dict(zip([id(s) for s, _ in wanted],
                           self._submit([(plan, s.prompt_ids, self._audio(s, plan[1]))
                                         for s, plan in wanted]), strict=True))
        outputs = [self._apply(s, done.get(id(s)), heard.get(id(s)), started.get(id(s)))
                   for s in states]
        if (not done and not heard and not started and all(o.partial is None for o in outputs)
                and any(s.decoding is not None for s in states)):
            time.sleep(DECODE_POLL_SECONDS)  # only decodes in flight: wait, do not spin
        return outputs

    def finish(self, state: TranscribeState) -> TranscribeResult:
        return TranscribeResult(
            text=" ".join(text for text in state.texts if text),
            audio_ms=round(1000 * state.received / state.rule.sample_rate),
            segments=len(state.texts), decode_seconds=state.decode_seconds)

    def release(self, state: TranscribeState) -> None:
        state.audio = np.zeros(0, np.float32)
        state.queue.clear()
        state.decoding = state.early = None  # a decode in flight finishes unseen

    def batch_key(self, state: TranscribeState) -> Hashable:
        return self.stage

    # -- planning and applying one step -------------------------------------------------------

    def _next_decode(self, state: TranscribeState) -> tuple[_Kind, _Span] | None:
        """The decode this state should start now, if any (it has none in flight)."""
        first = state.first_span()
        if first is not None:
            early = state.early
            return None if early is not None and early[0] == first[1] else (_Kind.FINAL,
                                                                             first[1])
        if self._early_due(state):
            assert state.speech_start is not None and state.silence_since is not None
            return _Kind.EARLY, _Span(state.speech_start,
                                      state.silence_since + self._samples(END_PAD_MS))
        if self._partial_due(state):
            assert state.speech_start is not None
            return _Kind.PARTIAL, _Span(state.speech_start, state.heard)
        return None

    def _early_due(self, state: TranscribeState) -> bool:
        """A pause in the open segment has lasted END_PAD_MS (a close would keep that much
        of it), is shorter than the silence that closes, and has no early decode yet."""
        pad, rule = self._samples(END_PAD_MS), state.rule
        if not rule.vad or state.speech_start is None or state.silence_since is None:
            return False
        return (pad < self._samples(rule.silence_duration_ms)
                and state.early_end != state.silence_since + pad
                and state.heard - state.silence_since >= pad)

    def _partial_due(self, state: TranscribeState) -> bool:
        interval = state.rule.partial_interval_ms
        if state.speech_start is None or interval <= 0 or state.final:
            return False
        return (state.heard - state.last_partial >= self._samples(interval)
                and state.heard - state.speech_start >= self._samples(MIN_PARTIAL_MS))

    def _audio(self, state: TranscribeState, span: _Span) -> Floats:
        return state.audio[span.start - state.base : span.end - state.base]

    def _apply(self, state: TranscribeState, finished: _Decode | None,
               heard: tuple[Floats, VadStream] | None,
               started: _Decode | None) -> StepOutput[TranscriptEvent]:
        before = (len(state.queue), state.heard)
        if finished is not None:
            state.decoding = None
            state.decode_seconds += (time.perf_counter() - finished.submitted) / finished.batch
            self._take(state, finished)
        if heard is not None:
            state.vad = heard[1]
            self._segment_speech(state, heard[0])
        if started is not None:
            state.decoding = started
            if started.kind is _Kind.PARTIAL:
                state.last_partial = started.span.end
            elif started.kind is _Kind.EARLY:
                state.early_end = started.span.end
        if state.final and state.speech_start is not None and not state.unheard_windows():
            self._close(state, state.heard, stopped=state.rule.vad)
        self._settle(state)
        event: TranscriptEvent | None = None
        if state.queue and not isinstance(state.queue[0], _Span):
            item = state.queue.popleft()
            assert not isinstance(item, _Span)
            event = item
        self._trim(state)
        if finished is not None or started is not None or (len(state.queue), state.heard) != before:
            state.steps += 1
        done = (event is None and state.final and not state.queue and state.decoding is None
                and state.speech_start is None and not state.unheard_windows())
        busy = bool(state.queue or state.decoding is not None or state.unheard_windows()
                    or self._early_due(state) or self._partial_due(state) or state.final)
        return StepOutput(step_index=state.steps, partial=event, finished=done,
                          waiting_for_input=not (busy or done))

    def _take(self, state: TranscribeState, decode: _Decode) -> None:
        """A finished decode: a final text in its segment's place, an early text kept for the
        close, a partial text queued while its segment is still open (else dropped)."""
        decoded = decode.decoded
        assert decoded is not None
        if decode.kind is _Kind.FINAL:
            first = state.first_span()
            assert first is not None and first[1] == decode.span
            self._finalize(state, first[0], decode.span, decoded)
        elif decode.kind is _Kind.EARLY:
            state.early = (decode.span, decoded)
            if state.rule.early_partials and self._pausing_at(state, decode.span):
                state.queue.append(self._partial(state, decode.span, decoded))
                state.early_sent = True
        elif state.speech_start == decode.span.start:
            state.queue.append(self._partial(state, decode.span, decoded))

    def _partial(self, state: TranscribeState, span: _Span, decoded: _Decoded) -> Segment:
        """A partial text of the open segment (its index follows the closed ones)."""
        return self._segment(state, len(state.texts) + _queued_spans(state), span.start,
                             span.end, decoded, False)

    def _pausing_at(self, state: TranscribeState, span: _Span) -> bool:
        """The open segment is still in the pause that `span` (an early decode) ends in."""
        return (state.speech_start == span.start and state.silence_since is not None
                and span.end == state.silence_since + self._samples(END_PAD_MS))

    def _settle(self, state: TranscribeState) -> None:
        """The oldest closed segment takes the early text decoded on exactly its audio."""
        first, early = state.first_span(), state.early
        if first is not None and early is not None and early[0] == first[1]:
            self._finalize(state, first[0], first[1], early[1])
            state.early = None

    def _finalize(self, state: TranscribeState, place: int, span: _Span,
                  decoded: _Decoded) -> None:
        state.queue[place] = self._segment(state, len(state.texts), span.start, span.end,
                                           decoded, True)
        state.texts.append(decoded.text)

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
                if state.early_sent:
                    self._withdraw_early(state)
                state.silence_since = None
            elif prob < rule.vad_threshold - VAD_HYSTERESIS and state.silence_since is None:
                state.silence_since = self._quiet_since(state, at)
            if state.silence_since is not None and state.heard - state.silence_since >= silence:
                self._close(state, state.silence_since, stopped=True)
            elif state.heard - state.speech_start >= longest:  # too long for one window
                if state.early_sent:
                    self._withdraw_early(state)
                state.queue.append(_Span(state.speech_start, state.heard))
                state.speech_start = state.last_partial = state.heard
                state.silence_since = None  # a pause is counted within its segment

    def _quiet_since(self, state: TranscribeState, at: int) -> int:
        """Where a pause that the detector hears from window `at` began: before `at`, back over
        the quiet windows (QUIET_PEAK) that the detector still counted as voice, never before
        the segment's start."""
        assert state.speech_start is not None
        floor = max(state.speech_start, state.base, at - self._samples(MAX_QUIET_LOOKBACK_MS))
        since = at
        while (since - VAD_WINDOW >= floor and float(np.abs(
                state.audio[since - VAD_WINDOW - state.base : since - state.base]).max())
               < QUIET_PEAK):
            since -= VAD_WINDOW
        return since

    def _close(self, state: TranscribeState, speech_end: int, stopped: bool) -> None:
        """Close the open segment where its speech ended; queue SpeechStopped and its decode."""
        assert state.speech_start is not None
        end = min(speech_end + self._samples(END_PAD_MS), state.heard)
        if stopped:
            state.queue.append(SpeechStopped(self._ms(speech_end)))
        if end > state.speech_start:
            state.queue.append(_Span(state.speech_start, end))
        state.closed_end = end
        state.speech_start = state.silence_since = None
        state.early_sent = False  # its final text follows

    def _withdraw_early(self, state: TranscribeState) -> None:
        """Speech resumed after an early text was sent: an empty partial withdraws it."""
        assert state.speech_start is not None
        state.queue.append(self._partial(state, _Span(state.speech_start, state.heard),
                                         _Decoded("", 0.0)))
        state.early_sent = False

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

    def _submit(self, wanted: list[tuple[tuple[_Kind, _Span], list[int], Floats]]
                ) -> list[_Decode]:
        """Start one decode pass over a batch of (what, prompt, audio); returns at once."""
        if not wanted:
            return []
        jobs = self._generate([(audio, prompt) for _, prompt, audio in wanted])
        now = time.perf_counter()
        decodes = [_Decode(kind, span, job, now, len(wanted))
                   for ((kind, span), _, _), job in zip(wanted, jobs, strict=True)]
        self._in_flight += decodes
        return decodes

    def _generate(self, spans: list[tuple[Floats, list[int]]]) -> list[_Job]:
        """Greedy decode passes over a batch of (audio, prompt), on CTranslate2's thread: one
        pass per window length, since a span's window follows from its own length (so its
        text does not depend on its batch mates)."""
        windows = [self._window(audio, prompt) for audio, prompt in spans]
        jobs: dict[int, _Job] = {}
        for seconds in sorted(set(windows)):
            members = [i for i, window in enumerate(windows) if window == seconds]
            features = np.stack([log_mel(spans[i][0], self.folder.n_mels, seconds)
                                 for i in members])
            running = self._model.generate(
                ctranslate2.StorageView.from_array(features), [spans[i][1] for i in members],
                beam_size=1, return_no_speech_prob=True, asynchronous=True)
            jobs.update((i, _Whispered(one, self._tokenizer, features))
                        for i, one in zip(members, running, strict=True))
        return [jobs[i] for i in range(len(spans))]

    def _window(self, audio: Floats, prompt: list[int]) -> int:
        """Seconds of window a decode of `audio` hears: the shortest of DECODE_WINDOWS_SECONDS
        that leaves DECODE_PAD_SECONDS of padding, else Whisper's whole 30 s; the whole 30 s
        with a caller's prompt (previous text made tiny.en repeat a sentence in 10 s)."""
        if prompt and prompt[0] == self._token("<|startofprev|>"):
            return WINDOW_SECONDS
        needed = audio.shape[0] / self.sample_rate + DECODE_PAD_SECONDS
        return next((w for w in DECODE_WINDOWS_SECONDS if w >= needed), WINDOW_SECONDS)

    def _collect(self, decode: _Decode) -> _Decode:
        """A done decode with its text (kept: a step rerun after a failure reads it again)."""
        if decode.decoded is None:
            decode.decoded = decode.job.result()
        return decode

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
