"""The Codec stage: codec frames -> audio. Which adapter serves a model folder is decided by the
folder's family: a Piper folder (`stagemesh.models.families.piper`) gets the Piper decoder (ONNX
Runtime, latent z frames), any other folder the Mimi codec (transformers, codes)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagemesh.shared.stage_runtime import StageBundle


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """The Codec stage of `model_dir`'s family (imports only that family's runtime)."""
    from stagemesh.models.families import PIPER_FAMILY, family_of

    if family_of(model_dir) == PIPER_FAMILY:
        import torch  # the stage's thread share is set on torch (`stagemesh stage --threads`)

        from stagemesh.services.codec.piper_servicer import build_stage as build_piper

        return build_piper(model_dir, options, threads=torch.get_num_threads())
    from stagemesh.services.codec.servicer import build_stage as build_csm

    return build_csm(model_dir, options)
