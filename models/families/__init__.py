"""Model families: the types and facts a family's stages share, read from the model folder.

A stage imports its family's module, never another stage's adapter, and never a builder: the
builders in `stagemesh.models` write folders in the family's layout, these modules read them.
"""

from __future__ import annotations

import json
from pathlib import Path

from stagemesh.shared.extras import VOICE_GPL, Extra
from stagemesh.shared.limits import CLONE_VOICE, DEFAULT_VOICE

#: Voice names with a meaning of their own on the wire; no model may name a voice so.
RESERVED_VOICE_NAMES = (DEFAULT_VOICE, CLONE_VOICE)
#: The file in which a folder that stagemesh prepared names its family (`{"family": ...}`);
#: a folder without one is a plain checkpoint (diffusers / transformers layout).
CONFIG_FILE = "stagemesh.json"
#: The family of Piper voices split at z (`stagemesh.models.families.piper`).
PIPER_FAMILY = "piper"


def family_of(model_dir: str | Path) -> str | None:
    """The family a prepared folder names, or None for a plain checkpoint folder. Reads one
    small file: stages call it to pick their adapter before importing any runtime."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    family = json.loads(path.read_text()).get("family")
    return str(family) if family is not None else None


#: The optional extra a family's stage needs (family -> stage -> extra): the Piper talker
#: phonemizes with piper-tts. `stagemesh serve` skips a recipe whose stage needs one that is
#: not installed (`stagemesh model prepare --json` reports them).
STAGE_EXTRAS: dict[str, dict[str, Extra]] = {PIPER_FAMILY: {"talker": VOICE_GPL}}


def stage_extras(model_dir: str | Path) -> dict[str, Extra]:
    """Stage name -> the extra that stage needs to serve this folder's family (most: none)."""
    return STAGE_EXTRAS.get(family_of(model_dir) or "", {})
