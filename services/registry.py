"""Stage name -> the function that builds it. Imported lazily: a Codec process never loads
diffusers, a VAE process never loads the talker."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from stagemesh.shared.stage_runtime import StageBundle

#: Builds a stage from its model folder and its recipe options.
StageBuilder = Callable[[Path, Mapping[str, object]], StageBundle]


def _tokenizer() -> StageBuilder:
    from stagemesh.services.tokenizer.servicer import build_stage

    return build_stage


def _dit() -> StageBuilder:
    from stagemesh.services.dit.servicer import build_stage

    return build_stage


def _vae() -> StageBuilder:
    from stagemesh.services.vae.servicer import build_stage

    return build_stage


def _talker() -> StageBuilder:
    from stagemesh.services.talker import build_stage  # picks the adapter by model family

    return build_stage


def _codec() -> StageBuilder:
    from stagemesh.services.codec import build_stage  # picks the adapter by model family

    return build_stage


def _thinker() -> StageBuilder:
    from stagemesh.services.thinker.servicer import build_stage

    return build_stage


def _transcriber() -> StageBuilder:
    from stagemesh.services.transcriber import build_stage

    return build_stage


#: Each stage's builder, behind an import that runs only when that stage is built.
STAGE_BUILDERS: dict[str, Callable[[], StageBuilder]] = {
    "tokenizer": _tokenizer,
    "dit": _dit,
    "vae": _vae,
    "talker": _talker,
    "codec": _codec,
    "thinker": _thinker,
    "transcriber": _transcriber,
}


def build_stage(
    name: str, model_dir: Path, options: Mapping[str, object] | None = None
) -> StageBundle:
    """Load the stage's model from `model_dir` and return its engines and servicers.

    `options` are the recipe's options for this stage; unknown keys or wrong types raise
    ValueError naming the stage and the key.
    """
    if name not in STAGE_BUILDERS:
        raise ValueError(f"unknown stage {name!r}; known: {sorted(STAGE_BUILDERS)}")
    return STAGE_BUILDERS[name]()(Path(model_dir), dict(options or {}))
