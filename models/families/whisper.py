"""The Whisper family for the Transcriber stage: a CTranslate2 Whisper, its tokenizer, and the
Silero voice activity detector, in one folder.

`stagemesh model prepare builtin:whisper-tiny-en` (`stagemesh.models.whisper`) writes this
layout (ours):

    whisper-tiny-en/
      stagemesh.json     {"family": "whisper-ct2", "sample_rate": 16000, "n_mels": 80,
                          "languages": ["en"], "vad": "silero_vad.onnx", "version": ...}
      model.bin          the CTranslate2 Whisper (int8-capable), with its config.json
      config.json
      tokenizer.json     the model's BPE (Hugging Face `tokenizers` format)
      vocabulary.txt
      silero_vad.onnx    Silero VAD v6 (MIT): 512-sample windows at 16 kHz with 64 samples of
                         context, LSTM state [2, 1, 128] carried between calls

This module reads the folder; it never builds one (see `stagemesh.models.whisper`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from stagemesh.models.families import CONFIG_FILE

FAMILY = "whisper-ct2"
TOKENIZER_FILE = "tokenizer.json"
VAD_FILE = "silero_vad.onnx"
#: The CTranslate2 model's own files (read by `ctranslate2.models.Whisper`).
MODEL_FILES = ("model.bin", "config.json", "vocabulary.txt")


@dataclass(frozen=True)
class WhisperFolder:
    """A prepared Whisper folder and the facts the Transcriber stage needs."""

    root: Path
    tokenizer_file: Path
    vad_graph: Path
    sample_rate: int  # what the model hears (Whisper: 16 kHz)
    n_mels: int
    languages: tuple[str, ...]  # the first is the default; an English-only model has "en"

    @property
    def multilingual(self) -> bool:
        return len(self.languages) > 1

    @classmethod
    def load(cls, model_dir: str | Path) -> WhisperFolder:
        root = Path(model_dir)
        config = json.loads((root / CONFIG_FILE).read_text())
        if config.get("family") != FAMILY:
            raise ValueError(f"{root} is not a {FAMILY} folder (family "
                             f"{config.get('family')!r})")
        return cls(root=root, tokenizer_file=root / TOKENIZER_FILE,
                   vad_graph=root / str(config.get("vad", VAD_FILE)),
                   sample_rate=int(config["sample_rate"]), n_mels=int(config["n_mels"]),
                   languages=tuple(str(code) for code in config["languages"]))
