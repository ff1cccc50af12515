"""The Transcriber stage: streamed speech -> speech events and transcript segments (Whisper on
CTranslate2, Silero VAD on ONNX Runtime; `stagemesh.models.families.whisper`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagemesh.shared.stage_runtime import StageBundle


def build_stage(model_dir: Path, options: Mapping[str, object]) -> StageBundle:
    """The Transcriber stage of a Whisper folder, on the stage's thread share."""
    import torch  # the stage's thread share is set on torch (`stagemesh stage --threads`)

    from stagemesh.services.transcriber.servicer import build_stage as build_whisper

    return build_whisper(model_dir, options, threads=torch.get_num_threads())
