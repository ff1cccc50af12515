"""What a diffusers model folder says about its model: the one reader of the class names
(`_class_name`) by which a stage picks its model family's adapter.

A prepared folder's family (`stagemesh.json`) is read by `stagemesh.models.families.family_of`
and picks the stage's builder (`services.registry`); a plain diffusers folder names its pipeline
class in `model_index.json` and each component's class in `<component>/config.json`, read here.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The file in which a diffusers folder names its pipeline and components.
PIPELINE_INDEX = "model_index.json"


def folder_class(model_dir: str | Path, component: str | None = None) -> str | None:
    """The class the folder names: its pipeline's (`model_index.json`) or, given `component`,
    that component's (`<component>/config.json`); None when the file is absent or names none."""
    name = PIPELINE_INDEX if component is None else f"{component}/config.json"
    path = Path(model_dir) / name
    if not path.is_file():
        return None
    class_name = json.loads(path.read_text()).get("_class_name")
    return class_name if isinstance(class_name, str) else None
