"""What the Transcriber hears, in numpy: a streaming resampler (shared/resample.py, which the
gateway's realtime route uses too), Whisper's log-mel spectrogram
and the Silero voice activity detector (ONNX Runtime), each fed chunk by chunk.

No torch, no PyAV: the stage's runtime is CTranslate2, ONNX Runtime and numpy (see
docs/speech-and-chat.md for why).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime  # type: ignore[import-untyped]  # ships no type information

from stagemesh.shared.resample import Floats

#: Whisper's front end (openai/whisper audio.py): 25 ms windows every 10 ms at 16 kHz, 30 s
#: of audio per decode, log-mel floored 8 (log10 units) below its peak.
N_FFT, HOP = 400, 160
WINDOW_SECONDS = 30
#: Silero VAD v6 at 16 kHz (the silero-vad wheel's graph): 512 new samples per window, after 64
#: of the previous one; the LSTM's h and c stacked as one `state` [2, batch=1, 128].
VAD_RATE, VAD_WINDOW, VAD_CONTEXT, VAD_STATE = 16_000, 512, 64, (2, 1, 128)


@functools.cache
def _mel_filters(n_mels: int) -> npt.NDArray[np.float64]:
    """[n_fft/2 + 1, n_mels] Slaney mel filters, exactly as Whisper's feature extractor."""
    from transformers.audio_utils import mel_filter_bank

    filters: npt.NDArray[np.float64] = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=n_mels, min_frequency=0.0,
        max_frequency=8000.0, sampling_rate=16_000, norm="slaney", mel_scale="slaney")
    return filters


@functools.cache
def _hann() -> npt.NDArray[np.float64]:
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic


def log_mel(audio: Floats, n_mels: int, seconds: int = WINDOW_SECONDS) -> Floats:
    """Whisper's input [n_mels, 100 * seconds] for up to `seconds` of 16 kHz audio (3000
    frames for 30 s, the window Whisper was trained on), as transformers'
    `WhisperFeatureExtractor` computes it (zero padding to the window, centred reflect-padded
    STFT), but only over the frames that hold audio: the padding's frames are silence by
    definition (log10 of the 1e-10 floor), so they are filled in, not computed. A shorter
    window gives the same frames, less padding."""
    samples = seconds * 16_000
    frames = samples // HOP
    audio = audio[:samples].astype(np.float64)
    padded = np.zeros(samples)
    padded[: audio.shape[0]] = audio
    signal = np.pad(padded, N_FFT // 2, mode="reflect")  # the centred STFT's padding
    voiced = min(frames, (audio.shape[0] + N_FFT // 2) // HOP + 1)
    strided = np.lib.stride_tricks.sliding_window_view(signal, N_FFT)[: voiced * HOP : HOP]
    power = np.abs(np.fft.rfft(strided * _hann(), axis=1)) ** 2
    mel = np.full((frames, n_mels), 1e-10)
    mel[:voiced] = np.maximum(power @ _mel_filters(n_mels), 1e-10)
    log = np.log10(mel)
    log = np.maximum(log, log.max() - 8.0)
    return np.ascontiguousarray(((log + 4.0) / 4.0).T, dtype=np.float32)


@dataclass
class VadStream:
    """One stream's detector state: the LSTM's (h, c) and the last window's context."""

    state: Floats = field(default_factory=lambda: np.zeros(VAD_STATE, np.float32))
    context: Floats = field(default_factory=lambda: np.zeros(VAD_CONTEXT, np.float32))


class SileroVad:
    """Silero VAD v6 on ONNX Runtime: speech probabilities of consecutive 512-sample windows."""

    def __init__(self, graph: Path) -> None:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1  # tiny LSTM
        options.log_severity_level = 4
        self._session = onnxruntime.InferenceSession(
            str(graph), sess_options=options, providers=["CPUExecutionProvider"])
        self._rate = np.array(VAD_RATE, np.int64)

    def probabilities(self, stream: VadStream, audio: Floats) -> tuple[Floats, VadStream]:
        """One probability per whole window of `audio` (a multiple of 512 samples), and the
        stream's next state (the given one is left as it was)."""
        windows = audio.reshape(-1, VAD_WINDOW)
        contexts = np.concatenate([stream.context[None], windows[:-1, -VAD_CONTEXT:]])
        inputs = np.concatenate([contexts, windows], axis=1)
        # The graph's batch axis is independent streams, so one stream's windows run in turn,
        # each carrying the state (~0.1 ms a window).
        state, probs = stream.state, np.empty(len(windows), np.float32)
        for i, window in enumerate(inputs):
            prob, state = self._session.run(
                None, {"input": window[None], "state": state, "sr": self._rate})
            probs[i] = float(np.asarray(prob).reshape(-1)[0])
        return probs, VadStream(state=state, context=windows[-1, -VAD_CONTEXT:].copy())
