"""The optional extras of the stagemesh package (pyproject's [project.optional-dependencies])
that serving needs: which module each one provides, and how to tell whether it is installed.

Both are GPL-licensed, so stagemesh (Apache-2.0) installs neither by default: a model family
declares the extra a stage of its needs (`stagemesh.models.families.STAGE_EXTRAS`), and
`stagemesh serve` skips the recipes whose stages need an extra that is not installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Extra:
    """One optional extra: `pip install 'stagemesh[NAME]'` provides `module`."""

    name: str
    module: str  # the top-level module it installs
    what: str  # what it is, for messages

    @property
    def install_hint(self) -> str:
        return f"pip install 'stagemesh[{self.name}]'"

    def installed(self) -> bool:
        """Whether its module can be imported here (found, not imported: importing the
        phonemizer loads espeak-ng)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # a broken install, or a module hidden from us
            return False


#: The Piper voice's phonemizer: piper-tts with espeak-ng inside (GPL-3.0-or-later).
VOICE_GPL = Extra("voice-gpl", "piper",
                  "piper-tts, the Piper voice's phonemizer, GPL-3.0-or-later")
#: H.264 MP4 muxing of videos: PyAV, whose wheel's FFmpeg links libx264 (GPL-2.0-or-later).
VIDEO_GPL = Extra("video-gpl", "av", "PyAV, the H.264 MP4 muxer, GPL through libx264")
#: Every extra by name.
EXTRAS = {extra.name: extra for extra in (VOICE_GPL, VIDEO_GPL)}
