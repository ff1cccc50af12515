"""Text -> phoneme ids per sentence for a Piper voice, with espeak-ng (the tokenizer role).

The phonemizer is espeak-ng as `piper-tts` bundles it (GPL-3.0-or-later). It is an optional
extra (`pip install 'stagemesh[voice-gpl]'`), imported only when a Piper talker starts, so a
stagemesh without it stays Apache-2.0 only; a Piper talker without it fails at start-up with the
command that installs it.

espeak-ng keeps one global voice in the process, so calls are serialised by a lock (the engine
thread is the only caller in a stage, but tests and benches may share a process).
"""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stagemesh.shared.extras import VOICE_GPL

#: The extra that installs the phonemizer, named where a missing one is reported.
GPL_EXTRA_HINT = f"{VOICE_GPL.install_hint} ({VOICE_GPL.what})"
#: Piper's id-map markers: sentence start and end, and the pad placed after every phoneme.
BOS, EOS, PAD = "^", "$", "_"

_LOCK = threading.Lock()


class PhonemizerMissing(RuntimeError):
    """The optional GPL phonemizer is not installed."""


@dataclass(frozen=True)
class Sentence:
    """One sentence as the voice reads it: its phonemes and their ids (with markers)."""

    phonemes: str
    ids: tuple[int, ...]


class EspeakPhonemizer:
    """espeak-ng phonemes in Piper's id layout: `^ _ p1 _ p2 _ ... $` per sentence."""

    def __init__(self, espeak_voice: str, id_map: Mapping[str, Sequence[int]]) -> None:
        try:
            from piper.phonemize_espeak import EspeakPhonemizer as PiperEspeak
        except ImportError as error:
            raise PhonemizerMissing(
                f"the Piper voice needs the espeak-ng phonemizer: {GPL_EXTRA_HINT}") from error
        missing = [marker for marker in (BOS, EOS, PAD) if marker not in id_map]
        if missing:
            raise ValueError(f"the voice's phoneme_id_map lacks {missing}")
        with _LOCK:
            self._espeak = PiperEspeak()
        self._voice = espeak_voice
        self._id_map = {key: tuple(ids) for key, ids in id_map.items()}

    def sentences(self, text: str) -> list[Sentence]:
        """The text's sentences (espeak-ng's own clause and sentence detection), in order;
        phonemes the voice lacks are dropped, as Piper does."""
        with _LOCK:
            groups = self._espeak.phonemize(self._voice, unicodedata.normalize("NFC", text))
        return [self._sentence(group) for group in groups if any(p.strip() for p in group)]

    def _sentence(self, phonemes: Sequence[str]) -> Sentence:
        pad = self._id_map[PAD]
        ids: list[int] = [*self._id_map[BOS], *pad]
        for phoneme in phonemes:
            if phoneme in self._id_map:
                ids.extend((*self._id_map[phoneme], *pad))
        ids.extend(self._id_map[EOS])
        return Sentence(phonemes="".join(phonemes), ids=tuple(ids))
