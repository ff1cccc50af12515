"""Model specs in recipes: a folder path, or `builtin:<name>` for a model stagemesh provides.

Built-in models are either shipped in the repository (trained here) or built on first use from
seeded configs into a cache folder; both load through the same `from_pretrained` path as a real
checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from stagemesh.models.families import PIPER_FAMILY, STAGE_EXTRAS
from stagemesh.shared.extras import Extra

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TINY_SHAPES = REPO_ROOT / "assets" / "tiny-shapes"
SHIPPED_TINY_SHAPES_EDIT = REPO_ROOT / "assets" / "tiny-shapes-edit"
SHIPPED_TINY_SHAPES_VIDEO = REPO_ROOT / "assets" / "tiny-shapes-video"


def _shipped(folder: Path, name: str) -> Callable[[], Path]:
    def find() -> Path:
        if not (folder / "model_index.json").exists():
            raise FileNotFoundError(f"{folder} is missing; run `stagemesh train {name}` to "
                                    "rebuild it")
        return folder
    return find


def _qwen_image(preset: str) -> Callable[[], Path]:
    def build() -> Path:
        from stagemesh.models.qwen_image import ensure_model

        return ensure_model(preset)
    return build


def _qwen_image_edit() -> Path:
    from stagemesh.models.qwen_image_edit import ensure_edit_model

    return ensure_edit_model()


def _wan(variant: Literal["t2v", "i2v"]) -> Callable[[], Path]:
    def build() -> Path:
        from stagemesh.models.wan import ensure_wan_model

        return ensure_wan_model(variant)
    return build


def _speech() -> Path:
    from stagemesh.models.speech import ensure_speech_model

    return ensure_speech_model()


def _piper_joe() -> Path:
    from stagemesh.models.piper import ensure_piper_model

    return ensure_piper_model()


def _smollm2() -> Path:
    from stagemesh.models.smollm2 import ensure_smollm2

    return ensure_smollm2()


def _whisper_tiny_en() -> Path:
    from stagemesh.models.whisper import ensure_whisper_model

    return ensure_whisper_model()


BUILTIN: dict[str, Callable[[], Path]] = {
    "tiny-shapes": _shipped(SHIPPED_TINY_SHAPES, "tiny-shapes"),
    "tiny-shapes-edit": _shipped(SHIPPED_TINY_SHAPES_EDIT, "tiny-shapes-edit"),
    "tiny-shapes-video": _shipped(SHIPPED_TINY_SHAPES_VIDEO, "tiny-shapes-video"),
    "qwen-image-tiny": _qwen_image("tiny"),
    "qwen-image-bench": _qwen_image("bench"),
    "qwen-image-edit-tiny": _qwen_image_edit,
    "wan-t2v-tiny": _wan("t2v"),
    "wan-i2v-tiny": _wan("i2v"),
    "csm-tiny": _speech,
    "piper-joe": _piper_joe,
    "smollm2-135m": _smollm2,
    "whisper-tiny-en": _whisper_tiny_en,
}

#: The family of each built-in model whose family has a stage that needs an optional extra
#: (`stagemesh.models.families.STAGE_EXTRAS`): known before the model is built, so that
#: `stagemesh serve --strict` refuses at once instead of after preparing every model.
BUILTIN_FAMILIES: dict[str, str] = {"piper-joe": PIPER_FAMILY}


def builtin_stage_extras(spec: str) -> dict[str, Extra]:
    """Stage -> the extra it needs, for a `builtin:<name>` spec, without building the model;
    empty for a folder path (its family is read once prepared: `families.stage_extras`)."""
    if not spec.startswith("builtin:"):
        return {}
    return STAGE_EXTRAS.get(BUILTIN_FAMILIES.get(spec.removeprefix("builtin:"), ""), {})


def resolve_model(spec: str) -> Path:
    """`builtin:<name>` -> its folder (built if needed); anything else is a folder path."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN:
            raise ValueError(f"unknown built-in model {name!r}; known: {sorted(BUILTIN)}")
        return BUILTIN[name]()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    return path
