"""Helpers of the video suites (tests/integration/test_video_stages.py, tests/e2e/
test_serve_video.py): a multipart form as `curl -F` sends it, and an MP4's frames."""

from __future__ import annotations

import io
from typing import Any

import av
import numpy as np


def form(**fields: str) -> dict[str, Any]:
    """A multipart form, as `curl -F name=value` sends it (httpx's `files=` keyword)."""
    return {"files": [(name, (None, value.encode(), "text/plain"))
                      for name, value in fields.items()]}


def frames_of(mp4: bytes) -> list[np.ndarray]:
    """The RGB frames of an MP4, decoded with PyAV."""
    with av.open(io.BytesIO(mp4), "r") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
