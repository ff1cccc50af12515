"""H.264 MP4 from decoded frames, muxed as they arrive (PyAV).

The VAE streams a video's frames in chunks; each chunk is encoded and written at once, so the
gateway never holds a whole video of raw frames. Every call here is CPU (and file) work: callers
run it off the event loop (pipeline.py does, one call at a time, in order).

PyAV is the optional extra `video-gpl`: its wheel bundles FFmpeg with libx264 (GPL). It is
imported only when a video is made, so a gateway without it serves everything else, and a video
request is refused with a 503 that names the extra (`check_encoder`).
"""

from __future__ import annotations

import importlib.util
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import grpc
import numpy as np
import numpy.typing as npt

from stagemesh.gateway.errors import GatewayError

if TYPE_CHECKING:
    from av.container import OutputContainer
    from av.video.stream import VideoStream

#: H.264 encoders to try, best first, with their options: libx264 (GPL) is what PyAV's wheel
#: bundles; libopenh264 (BSD) is what a BSD-only FFmpeg build would have.
ENCODERS: tuple[tuple[str, dict[str, str]], ...] = (
    ("libx264", {"crf": "18", "preset": "veryfast"}),
    ("libopenh264", {"b": "4M"}),
)
#: The pixel format every player takes (4:2:0: width and height must be even).
PIXEL_FORMAT = "yuv420p"
EXTRA = "video-gpl"


class EncoderMissing(GatewayError):
    """No H.264 encoder here: PyAV (the `video-gpl` extra) is not installed, or its FFmpeg has
    neither libx264 nor libopenh264."""

    def __init__(self, detail: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"this gateway cannot encode video: "
                         f"{detail} (install stagemesh[{EXTRA}])",
                         reason="VIDEO_ENCODER_MISSING")


def h264_encoder() -> tuple[str, dict[str, str]]:
    """The first H.264 encoder of ENCODERS this PyAV has; EncoderMissing if none."""
    if importlib.util.find_spec("av") is None:
        raise EncoderMissing("PyAV is not installed")
    import av.codec

    for name, options in ENCODERS:
        try:
            av.codec.Codec(name, "w")
        except (av.codec.codec.UnknownCodecError, ValueError):
            continue
        return name, options
    raise EncoderMissing("its FFmpeg has no H.264 encoder (libx264 or libopenh264)")


def check_encoder() -> None:
    """Refuse a video request before any stage runs when no MP4 could be written."""
    h264_encoder()


Frames = npt.NDArray[np.uint8]


class Mp4Writer:
    """One H.264 MP4 of `width` x `height` at `fps`, written to `target` (a path or a binary
    file object) frame chunk by frame chunk; `close` finishes the file."""

    def __init__(self, target: Path | BinaryIO, width: int, height: int, fps: int) -> None:
        if width % 2 or height % 2:
            raise ValueError(f"H.264 4:2:0 needs an even width and height, got {width}x{height}")
        import av
        from av.video.stream import VideoStream

        codec, options = h264_encoder()
        self.width, self.height = width, height
        self.frames = 0
        # A file gets its index first (playable while it downloads); that is a second pass
        # over the file, which a file object cannot give (its bytes are sent whole anyway).
        self._container: OutputContainer = av.open(
            str(target) if isinstance(target, Path) else target, mode="w", format="mp4",
            options={"movflags": "+faststart"} if isinstance(target, Path) else {})
        stream = self._container.add_stream(codec, rate=Fraction(fps), options=options)
        assert isinstance(stream, VideoStream)
        self._stream: VideoStream = stream
        self._stream.width, self._stream.height = width, height
        self._stream.pix_fmt = PIXEL_FORMAT
        self._closed = False

    def write(self, frames: Frames) -> None:
        """Encode uint8 RGB frames [n, height, width, 3], in order, and mux their packets."""
        import av

        if frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"frames must be [n, {self.height}, {self.width}, 3], got "
                             f"{list(frames.shape)}")
        for pixels in np.ascontiguousarray(frames, dtype=np.uint8):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = self.frames
            self._container.mux(self._stream.encode(frame))
            self.frames += 1

    def close(self) -> int:
        """Flush the encoder and finish the MP4; returns the frames written."""
        if not self._closed:
            self._closed = True
            try:
                self._container.mux(self._stream.encode(None))
            finally:
                self._container.close()
        return self.frames

    def abort(self) -> None:
        """Stop without finishing (the file is left incomplete: the caller removes it)."""
        if not self._closed:
            self._closed = True
            self._container.close()
