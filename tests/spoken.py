"""Helper of the listening suites (tests/model/test_transcriber_adapter.py, tests/integration/
test_transcriber_stage.py): our default voice (Piper joe, the talker and codec adapters)
speaking known sentences, with pauses between them, as mono float32 PCM at 22.05 kHz."""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

#: Six sentences the voice says clearly (Whisper tiny.en hears them within a word or two).
SENTENCES = (
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back before five o'clock tomorrow.",
    "The train to the city leaves every morning at eight.",
    "We are going to the beach this weekend with our friends.",
    "Can you tell me the way to the nearest library?",
)
PAUSE_SECONDS = 0.8


@functools.cache
def spoken(texts: tuple[str, ...] = SENTENCES,
           pause_seconds: float = PAUSE_SECONDS) -> tuple[npt.NDArray[np.float32], int]:
    """(pcm, sample_rate): each text spoken (seed 0), followed by `pause_seconds` of silence."""
    from stagemesh.models.piper import ensure_piper_model
    from stagemesh.services.codec.piper_adapter import PiperCodecAdapter
    from stagemesh.services.talker.piper_adapter import PiperTalkerAdapter, PiperTalkerInput
    from stagemesh.shared.engine.adapter import EngineRequest

    talker, codec = PiperTalkerAdapter(ensure_piper_model()), PiperCodecAdapter(
        ensure_piper_model())
    silence = np.zeros(int(pause_seconds * codec.sample_rate), np.float32)
    pieces = []
    for text in texts:
        state = talker.prepare(EngineRequest("spoken", PiperTalkerInput(text=text)))
        frames = []
        while True:
            out = talker.step([state])[0]
            if out.partial is not None:
                frames.append(out.partial)
            if out.finished:
                break
        pieces += [codec.decode(np.concatenate(frames)), silence]
    return np.concatenate(pieces), codec.sample_rate


def chunks(pcm: npt.NDArray[np.float32], rate: int,
           seconds: float = 0.1) -> list[npt.NDArray[np.float32]]:
    """`pcm` cut into `seconds`-long chunks, as a microphone sends it."""
    size = int(rate * seconds)
    return [pcm[i : i + size] for i in range(0, pcm.shape[0], size)]
