"""Stage name and model family -> the module that builds that stage: the one place a stage's
model family picks its builder. Imported lazily: a Codec process never loads diffusers, a VAE
process never loads the talker, a Piper stage never loads transformers.

The family is what a prepared folder names in its `stagemesh.json`
(`stagemesh.models.families.family_of`); a plain checkpoint folder (diffusers / transformers
layout) has none and gets the stage's default builder, which reads the folder's own pipeline
class where a stage serves several (read by `services.folders`: `dit.servicer.pipeline_class`,
`tokenizer.families`, `vae.kinds`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path

from stagemesh.models.families import PIPER_FAMILY, family_of
from stagemesh.shared.stage_runtime import StageBundle

#: Builds a stage from its model folder and its recipe options.
StageBuilder = Callable[[Path, Mapping[str, object]], StageBundle]

#: Each stage's builder modules (each has a `build_stage`: a StageBuilder) by model family;
#: None: a folder that names no family (or one the stage has no builder of its own for).
STAGE_BUILDERS: dict[str, dict[str | None, str]] = {
    "tokenizer": {None: "stagemesh.services.tokenizer.servicer"},
    "dit": {None: "stagemesh.services.dit.servicer"},
    "vae": {None: "stagemesh.services.vae.servicer"},
    "talker": {None: "stagemesh.services.talker.csm_servicer",
               PIPER_FAMILY: "stagemesh.services.talker.piper_servicer"},
    "codec": {None: "stagemesh.services.codec.csm_servicer",
              PIPER_FAMILY: "stagemesh.services.codec.piper_servicer"},
    "thinker": {None: "stagemesh.services.thinker.servicer"},
    "transcriber": {None: "stagemesh.services.transcriber.servicer"},
}


def stage_builder(name: str, model_dir: Path) -> StageBuilder:
    """The builder of stage `name` for the folder's family (imports only that builder)."""
    if name not in STAGE_BUILDERS:
        raise ValueError(f"unknown stage {name!r}; known: {sorted(STAGE_BUILDERS)}")
    families = STAGE_BUILDERS[name]
    module = families.get(family_of(model_dir), families[None])
    builder: StageBuilder = importlib.import_module(module).build_stage
    return builder


def build_stage(
    name: str, model_dir: Path, options: Mapping[str, object] | None = None
) -> StageBundle:
    """Load the stage's model from `model_dir` and return its engines and servicers.

    `options` are the recipe's options for this stage; unknown keys or wrong types raise
    ValueError naming the stage and the key.
    """
    return stage_builder(name, Path(model_dir))(Path(model_dir), dict(options or {}))
