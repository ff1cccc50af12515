"""Talker stage for a Piper voice: text -> latent z frames, sentence by sentence, in chunks.

The Piper talker graph (`stagemesh.models.families.piper`) is not autoregressive: one run turns
a sentence's phoneme ids into all of its z frames [192, T] (text encoder, duration predictor,
flow). So the request is split into sentences when it starts (espeak-ng, `piper_phonemes`); a
step either runs the graph for the next sentence and streams its first chunk, or streams the
next chunk of the current sentence. A cancel therefore lands between chunks and between
sentences, and a long text reaches the codec one sentence at a time.

Determinism: the stock graph draws noise inside ONNX Runtime; ours takes it as inputs. Each
sentence draws it from its own generator, `numpy.random.default_rng([seed, sentence index])`:
the duration noise [1, ids, 2], then the prior noise [1, frames, 192]. The frame count is only
known after the run, so the prior noise is drawn for a generous bound (`_NOISE_FRAMES_PER_ID`);
the graph crops it, and a draw frames-first keeps its prefix whatever the bound, so the same
seed gives the same audio. A sentence that outruns the bound is run again with twice as many.

The sampling fields of the Talker contract other than the seed (temperature, top_p, top_k) have
no meaning for this model and are ignored; the voice's own noise scales apply. No voice clone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import numpy as np
import numpy.typing as npt

from stagemesh.models.families.piper import (
    DURATION_NOISE,
    LATENT_OUTPUT,
    LENGTHS_INPUT,
    PHONEMES_INPUT,
    PRIOR_NOISE,
    SCALES_INPUT,
    PiperVoiceFolder,
    open_session,
)
from stagemesh.models.options import capped_option
from stagemesh.services.talker.piper_phonemes import EspeakPhonemizer, Sentence
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)
from stagemesh.shared.limits import CLONE_VOICE, DEFAULT_VOICE, MAX_SEED

logger = logging.getLogger(__name__)

Floats = npt.NDArray[np.float32]

#: Option defaults: OpenAI's speech API limit on `input`; frames per streamed chunk.
DEFAULT_MAX_INPUT_CHARS = 4096
DEFAULT_CHUNK_FRAMES = 32
#: Most frames one request may produce: 10 minutes of audio at 86.1 frames/s (a 4096-character
#: text takes about 5).
MAX_SECONDS = 600
#: Phoneme ids in one sentence: a longer one is refused (espeak-ng splits at clauses, so only
#: a run-on text without punctuation gets near it).
MAX_SENTENCE_IDS = 2000
#: Prior noise drawn per phoneme id before the run: ids alternate phoneme and pad, and speech
#: averages ~2.6 frames (11.6 ms each) per id, so 20 per id is a wide margin; a miss (ONNX
#: Runtime cannot broadcast the cropped noise onto the longer prior) retries with double, twice.
_NOISE_FRAMES_PER_ID = 20
_MAX_NOISE_RETRIES = 2
_NOISE_TOO_SHORT = "broadcast"


@dataclass(frozen=True)
class PiperTalkerLimits:
    """What the stage accepts (its Describe facts)."""

    voices: tuple[str, ...]
    default_voice: str
    max_input_chars: int
    max_new_frames: int
    default_max_new_frames: int
    frame_rate: float
    chunk_frames: int
    latent_channels: int


@dataclass(frozen=True)
class PiperTalkerInput:
    """One utterance. voice: a voice name, "default"/""/None, or "clone" (refused: a Piper
    voice cannot clone). max_new_frames None = the stage's default (the whole text)."""

    text: str
    voice: str | None = None
    seed: int = 0
    max_new_frames: int | None = None
    has_reference: bool = False


@dataclass(frozen=True)
class PiperTalkerResult:
    total_frames: int
    finish_reason: str  # "stop" (the text is spoken) or "length" (max_new_frames)


@dataclass
class PiperTalkerState:
    request_id: str
    seed: int
    max_new_frames: int
    sentences: list[Sentence]
    next_sentence: int = 0
    current: Floats | None = None  # [T, channels] z frames of the sentence being streamed
    cursor: int = 0  # frames of `current` already streamed
    emitted: int = 0
    steps: int = 0
    finish_reason: str = ""


class PiperTalkerAdapter:
    """The Talker stage's model: a Piper folder's talker graph and its phonemizer."""

    stage = "talker"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
        max_new_frames: int | None = None,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
        default_voice: str | None = None,
        threads: int = 1,
    ) -> None:
        self.folder = PiperVoiceFolder.load(model_dir)
        self._session = open_session(self.folder.talker_graph, threads)
        self._phonemizer = EspeakPhonemizer(self.folder.espeak_voice, self.folder.phoneme_id_map)
        most = math.ceil(MAX_SECONDS * self.folder.frame_rate)
        most = capped_option("max_new_frames", max_new_frames or most, most)
        voices = self.folder.voices
        default = voices[0] if default_voice is None else default_voice.lower()
        if default not in voices:
            raise ValueError(f"option default_voice={default_voice!r} is not one of {voices}")
        self.limits = PiperTalkerLimits(
            voices=voices, default_voice=default,
            max_input_chars=capped_option("max_input_chars", max_input_chars),
            max_new_frames=most, default_max_new_frames=most,
            frame_rate=self.folder.frame_rate,
            chunk_frames=capped_option("chunk_frames", chunk_frames),
            latent_channels=self.folder.latent_channels)

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: PiperTalkerInput) -> None:
        text, limit = payload.text.strip(), self.limits.max_input_chars
        if not text:
            raise InvalidInputError("input", "input is empty")
        if len(payload.text) > limit:
            raise InvalidInputError(
                "input", f"input has {len(payload.text)} characters, the limit is {limit}")
        self._check_voice(payload)
        if not 0 <= payload.seed <= MAX_SEED:
            raise InvalidInputError("seed", f"seed must be in [0, {MAX_SEED}], got {payload.seed}")
        most = self.limits.max_new_frames
        if payload.max_new_frames is not None and not 1 <= payload.max_new_frames <= most:
            raise InvalidInputError("max_new_tokens", f"max_new_tokens must be in [1, {most}], "
                                    f"got {payload.max_new_frames}")

    def _check_voice(self, payload: PiperTalkerInput) -> None:
        voice = (payload.voice or DEFAULT_VOICE).lower()
        if payload.has_reference or voice == CLONE_VOICE:
            raise InvalidInputError("voice", "this model cannot clone a voice")
        if voice != DEFAULT_VOICE and voice not in self.limits.voices:
            raise InvalidInputError(
                "voice", f"unknown voice {payload.voice!r}; known: {list(self.limits.voices)}")

    # -- engine contract ----------------------------------------------------------------------

    def prepare(self, request: EngineRequest[PiperTalkerInput]) -> PiperTalkerState:
        payload = request.payload
        sentences = self._phonemizer.sentences(payload.text)
        for sentence in sentences:
            if len(sentence.ids) > MAX_SENTENCE_IDS:
                raise InvalidInputError(
                    "input", f"a sentence has {len(sentence.ids)} phoneme ids, the limit is "
                    f"{MAX_SENTENCE_IDS}; add punctuation")
        return PiperTalkerState(
            request_id=request.request_id, seed=payload.seed, sentences=sentences,
            max_new_frames=payload.max_new_frames or self.limits.default_max_new_frames)

    def add_input(self, state: PiperTalkerState, payload: NoStream) -> None:
        assert_never(payload)  # the Piper talker takes its whole text at the start

    def step(self, states: Sequence[PiperTalkerState]) -> list[StepOutput[Floats]]:
        # The fallible work first (a run per state that needs its next sentence); states change
        # only once every run has succeeded (all or nothing).
        fresh = {id(s): self.sentence_frames(s.sentences[s.next_sentence], s.seed,
                                             s.next_sentence)
                 for s in states if _needs_sentence(s)}
        return [self._advance(state, fresh.get(id(state))) for state in states]

    def finish(self, state: PiperTalkerState) -> PiperTalkerResult:
        return PiperTalkerResult(total_frames=state.emitted, finish_reason=state.finish_reason)

    def release(self, state: PiperTalkerState) -> None:
        state.current = None
        state.sentences = []

    def batch_key(self, state: PiperTalkerState) -> Hashable:
        return self.stage

    # -- model --------------------------------------------------------------------------------

    def sentence_frames(self, sentence: Sentence, seed: int, index: int) -> Floats:
        """z frames [T, channels] of one sentence, with noise from (seed, index)."""
        ids = np.asarray([sentence.ids], dtype=np.int64)
        scales = self.folder.scales
        feeds: dict[str, npt.NDArray[np.generic]] = {
            PHONEMES_INPUT: ids,
            LENGTHS_INPUT: np.asarray([ids.shape[1]], dtype=np.int64),
            SCALES_INPUT: np.asarray([scales.noise_scale, scales.length_scale, scales.noise_w],
                                     dtype=np.float32)}
        channels = self.folder.noise_channels
        frames = _NOISE_FRAMES_PER_ID * ids.shape[1]
        for attempt in range(_MAX_NOISE_RETRIES + 1):
            rng = np.random.default_rng([seed, index])
            feeds[DURATION_NOISE] = rng.standard_normal(
                (1, ids.shape[1], channels[DURATION_NOISE]), dtype=np.float32)
            feeds[PRIOR_NOISE] = rng.standard_normal(
                (1, frames, channels[PRIOR_NOISE]), dtype=np.float32)
            try:
                z = self._session.run([LATENT_OUTPUT], feeds)[0]
            except Exception as error:  # ORT's own Fail type; only a too-short noise is retried
                if attempt == _MAX_NOISE_RETRIES or _NOISE_TOO_SHORT not in str(error):
                    raise
                logger.info("sentence needs more than %d noise frames; drawing more", frames)
                frames *= 2
                continue
            return np.ascontiguousarray(np.asarray(z, dtype=np.float32)[0].T)
        raise AssertionError("unreachable")

    def _advance(self, state: PiperTalkerState, fresh: Floats | None) -> StepOutput[Floats]:
        if fresh is not None:
            state.current, state.cursor = fresh, 0
            state.next_sentence += 1
        state.steps += 1
        current = state.current
        if current is None:  # no sentence at all (a text of only punctuation)
            state.finish_reason = "stop"
            return StepOutput(step_index=state.steps, finished=True)
        room = state.max_new_frames - state.emitted
        take = min(self.limits.chunk_frames, current.shape[0] - state.cursor, room)
        chunk = current[state.cursor : state.cursor + take]
        state.cursor += take
        state.emitted += take
        done_text = state.cursor >= current.shape[0] and state.next_sentence >= len(
            state.sentences)
        if state.emitted >= state.max_new_frames and not done_text:
            state.finish_reason = "length"
        elif done_text:
            state.finish_reason = "stop"
        return StepOutput(step_index=state.steps, partial=chunk if take else None,
                          finished=bool(state.finish_reason))


def _needs_sentence(state: PiperTalkerState) -> bool:
    exhausted = state.current is None or state.cursor >= state.current.shape[0]
    return exhausted and state.next_sentence < len(state.sentences)


#: The static proof that the adapter is the Talker stage's StageAdapter.
_: type[StageAdapter[PiperTalkerInput, NoStream, PiperTalkerState, Floats,
                     PiperTalkerResult]] = PiperTalkerAdapter
