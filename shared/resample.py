"""Band-limited streaming resampling in numpy: the Transcriber's front end resamples what it
hears to the model's rate, and the gateway's realtime route resamples the codec's audio to the
24 kHz its clients play (no model, no torch: a filter)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float32]


class StreamResampler:
    """Band-limited resampling of a stream, chunk by chunk, as one pass over the whole signal.

    Output sample n lies at input time n * orig / target; it is a Hann-windowed sinc (cutoff
    0.97 of the lower Nyquist rate, `zero_crossings` on each side) over the input around it, so
    it leaves once the input reaches `half_width` samples past it (or the input has ended).
    Samples before the start and after the end are zeros.
    """

    def __init__(self, orig_rate: int, target_rate: int, zero_crossings: int = 16) -> None:
        self.step = orig_rate / target_rate  # input samples per output sample
        self.cutoff = 0.97 * min(1.0, target_rate / orig_rate) / 2  # cycles per input sample
        self.half_width = zero_crossings / (2 * self.cutoff)  # in input samples
        self.identity = orig_rate == target_rate
        self._taps = np.arange(-math.ceil(self.half_width), math.ceil(self.half_width) + 1)
        self._kept: Floats = np.zeros(0, np.float32)
        self._base = 0  # input index of _kept[0]
        self._next = 0  # next output index

    def push(self, samples: Floats, final: bool = False) -> Floats:
        """The output samples that `samples` (the next input) completes; all of them if
        `final`."""
        if self.identity:
            return samples
        self._kept = np.concatenate([self._kept, samples])
        received = self._base + self._kept.shape[0]
        end = (math.ceil(received / self.step) if final
               else math.floor((received - 1 - self.half_width) / self.step) + 1)
        if end <= self._next:
            return np.zeros(0, np.float32)
        times = np.arange(self._next, end) * self.step
        index = np.floor(times).astype(np.int64)[:, None] + self._taps[None, :]
        offset = times[:, None] - index  # output time minus input time, in input samples
        window = np.where(np.abs(offset) <= self.half_width,
                          0.5 + 0.5 * np.cos(np.pi * offset / self.half_width), 0.0)
        weights = 2 * self.cutoff * np.sinc(2 * self.cutoff * offset) * window
        local = index - self._base
        inside = (local >= 0) & (local < self._kept.shape[0])
        values = np.where(inside, self._kept[np.clip(local, 0, max(self._kept.shape[0] - 1, 0))],
                          0.0) if self._kept.shape[0] else np.zeros_like(weights)
        out: Floats = (weights * values).sum(axis=1).astype(np.float32)
        self._next = end
        keep_from = max(self._base, math.floor(end * self.step - self.half_width) - 1)
        self._kept = self._kept[keep_from - self._base :]
        self._base = keep_from
        return out
