"""The one registry of model families: the class a model folder names -> its family (what it
is, what its DiT does, which stage builders serve it), and each stage's builder module. Read in
one place (`folder_family`). Builders are imported lazily: a Codec process never loads
diffusers, a VAE process never loads the talker, a Piper stage never loads transformers.

A folder's class name is the family a prepared folder names in its `stagemesh.json`
(`stagemesh.models.families.family_of`), else the pipeline class a diffusers folder names in
`model_index.json` (`services.folders.folder_class`); a plain transformers checkpoint names
neither and is served by each stage's default builder (CSM, the thinker, Whisper). A stage that
serves several families (Tokenizer, DiT, VAE) picks its adapter by `served_family`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stagemesh.models.families import PIPER_FAMILY, family_of
from stagemesh.services.folders import folder_class
from stagemesh.shared.stage_runtime import StageBundle

#: Builds a stage from its model folder and its recipe options.
StageBuilder = Callable[[Path, Mapping[str, object]], StageBundle]

#: The diffusion families (their names are published in stage facts: keep them stable).
QWEN_IMAGE, QWEN_IMAGE_EDIT, WAN = "qwen-image", "qwen-image-edit", "wan"
#: What the diffusion stages (Tokenizer, DiT, VAE) serve.
DIFFUSION_FAMILIES = (QWEN_IMAGE, QWEN_IMAGE_EDIT, WAN)


@dataclass(frozen=True)
class ModelFamily:
    """A model family as the stages see it."""

    name: str
    task: str = ""  # what its DiT does ("text-to-image", "image-edit", ...); "" without a DiT
    #: stage -> the module (its `build_stage`) serving this family, where not STAGE_BUILDERS'
    builders: Mapping[str, str] = field(default_factory=dict)


#: Each stage's builder module (each has a `build_stage`: a StageBuilder); a family may name
#: its own (ModelFamily.builders).
STAGE_BUILDERS: dict[str, str] = {
    "tokenizer": "stagemesh.services.tokenizer.servicer",
    "dit": "stagemesh.services.dit.servicer",
    "vae": "stagemesh.services.vae.servicer",
    "talker": "stagemesh.services.talker.csm_servicer",
    "codec": "stagemesh.services.codec.csm_servicer",
    "thinker": "stagemesh.services.thinker.servicer",
    "transcriber": "stagemesh.services.transcriber.servicer",
}

#: The class a folder names (see the module) -> its family.
FAMILIES: dict[str, ModelFamily] = {
    "QwenImagePipeline": ModelFamily(QWEN_IMAGE, "text-to-image"),
    "QwenImageEditPipeline": ModelFamily(QWEN_IMAGE_EDIT, "image-edit"),
    "WanPipeline": ModelFamily(WAN, "text-to-video"),
    "WanImageToVideoPipeline": ModelFamily(WAN, "image-to-video"),
    PIPER_FAMILY: ModelFamily(PIPER_FAMILY, builders={
        "talker": "stagemesh.services.talker.piper_servicer",
        "codec": "stagemesh.services.codec.piper_servicer"}),
}


def folder_family(model_dir: str | Path) -> tuple[str | None, ModelFamily | None]:
    """The class name the folder names and its family (None, None: it names none)."""
    name = family_of(model_dir) or folder_class(model_dir)
    return name, FAMILIES.get(name) if name is not None else None


def served_family(stage: str, model_dir: str | Path, served: Collection[str]) -> ModelFamily:
    """The folder's family, for a stage that serves the families named `served`; ValueError
    naming the classes it serves otherwise."""
    name, family = folder_family(model_dir)
    if family is None or family.name not in served:
        classes = sorted(key for key, known in FAMILIES.items() if known.name in served)
        raise ValueError(f"{model_dir}: the {stage} stage serves {classes}, not {name!r}")
    return family


def classes_of(family: str) -> dict[str, ModelFamily]:
    """The class names of `family`, with their records (Wan: one per task)."""
    return {name: known for name, known in FAMILIES.items() if known.name == family}


def stage_builder(name: str, model_dir: Path) -> StageBuilder:
    """The builder of stage `name` for the folder's family (imports only that builder)."""
    if name not in STAGE_BUILDERS:
        raise ValueError(f"unknown stage {name!r}; known: {sorted(STAGE_BUILDERS)}")
    _, family = folder_family(model_dir)
    module = (family.builders if family else {}).get(name, STAGE_BUILDERS[name])
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
