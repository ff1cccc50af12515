"""Stage name -> the module that builds it. Imported lazily: a Codec process never loads
diffusers, a VAE process never loads the talker."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from stagemesh.shared.stage_runtime import StageBundle

STAGE_MODULES = {
    "tokenizer": "stagemesh.services.tokenizer.servicer",
    "dit": "stagemesh.services.dit.servicer",
    "vae": "stagemesh.services.vae.servicer",
    "talker": "stagemesh.services.talker.servicer",
    "codec": "stagemesh.services.codec.servicer",
}


def build_stage(name: str, model_dir: Path, options: dict[str, Any] | None = None) -> StageBundle:
    """Load the stage's model from `model_dir` and return its engines and servicers."""
    if name not in STAGE_MODULES:
        raise ValueError(f"unknown stage {name!r}; known: {sorted(STAGE_MODULES)}")
    module = importlib.import_module(STAGE_MODULES[name])
    bundle: StageBundle = module.build_stage(Path(model_dir), dict(options or {}))
    return bundle
