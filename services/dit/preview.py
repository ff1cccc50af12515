"""Step previews: every k steps, a small picture of a DiT request's estimate of its result.

The estimate is the x0 prediction of flow matching, x0 = x_t - sigma_t * v (v: the guided
velocity the step used), taken for free from what the step computed anyway. A `Painter` turns
it into pixels on the DiT's device, and only the small uint8 picture crosses to the host; the
gateway encodes it as PNG off its event loop (nothing here touches PNG). Two painters
(`preview_decode.load_painter` picks one, by the stage option `preview_painter`):

- a linear latent-to-RGB projection that belongs to the VAE, the default (`Projection`,
  `vae/preview.json` in the model folder, fitted once by least squares on latents the VAE
  encoded from known pictures): a 3 x C matrix per latent pixel, ~1 ms, no second copy of big
  weights;
- the folder VAE's own decoder, when its weights are small (`preview_decode`): the picture the
  VAE stage will make, decoded from a latent grid no larger than the preview needs.

A folder with neither makes no previews (Describe: max_preview_size 0).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from prometheus_client import REGISTRY, CollectorRegistry, Histogram

from stagemesh.shared.engine.adapter import InvalidInputError

logger = logging.getLogger(__name__)

#: Where a model folder keeps its VAE's latent-to-RGB projection.
PROJECTION_FILE = Path("vae") / "preview.json"
#: The longest side a request may ask for, and the one it gets when it asks for none: a preview
#: is for judging a picture early, not for looking at it closely.
MAX_PREVIEW_SIZE = 256
DEFAULT_PREVIEW_SIZE = 128
#: The fewest steps between two previews (every step is allowed: the path is cheap).
MIN_PREVIEW_EVERY = 1


@dataclass(frozen=True)
class PreviewOptions:
    """What a request asked for: a preview every `every` steps, `size` pixels on its long side."""

    every: int
    size: int = DEFAULT_PREVIEW_SIZE


@dataclass(frozen=True)
class Preview:
    """The picture after `step_index` steps: uint8 RGB [height, width, 3] on the host."""

    step_index: int
    pixels: npt.NDArray[np.uint8]


class Painter(Protocol):
    """How a folder's latents become a preview's pixels."""

    @property
    def name(self) -> str:
        """What the painter is, for logs and benches ("decoder", "projection")."""
        ...

    def to_rgb(self, grid: torch.Tensor, size: int) -> torch.Tensor:
        """Latents [channels, h, w], as the DiT holds them -> rgb [3, H, W] in [0, 1] (float32,
        on their device), for a preview `size` pixels on its long side (resized afterwards)."""
        ...


#: The latent neighbourhood (kernel x kernel) each output block is read from: on encoded
#: tiny-shapes renders a 5 x 5 window recovers colour and position exactly and 70% of shapes,
#: where one latent pixel alone gets 60% of colours.
DEFAULT_KERNEL = 5
#: Ridge term of the fit. The DiT's x0 estimates are noisier than encoded pictures in
#: directions the decoder ignores; a strong ridge keeps the map off them (tiny-shapes previews
#: at step 12 of 16, colour and position right: 13/30 at 1, 25/30 at 300, 19/30 at 3000).
RIDGE = 300.0


@dataclass(frozen=True)
class Projection:
    """A linear latent-to-RGB map: one convolution over the latents (each output reads a
    `kernel` x `kernel` neighbourhood), each latent pixel giving a `factor` x `factor` block of
    rgb in [0, 1], the VAE's output range (pixel shuffle). kernel 1, factor 1 is the classic
    one colour per latent pixel; a window and the VAE's own factor keep what neighbouring
    latents say about the detail inside a block (a small picture's shapes)."""

    weight: torch.Tensor  # [3 * factor², channels, kernel, kernel]
    bias: torch.Tensor  # [3 * factor²]
    factor: int = 1

    def save(self, model_dir: Path) -> Path:
        path = model_dir / PROJECTION_FILE
        # 5 decimals: finer than a uint8 step, and the shipped file stays small
        path.write_text(json.dumps({"weight": self.weight.double().round(decimals=5).tolist(),
                                    "bias": self.bias.double().round(decimals=5).tolist(),
                                    "factor": self.factor}))
        return path

    @classmethod
    def load(cls, model_dir: str | Path) -> Projection | None:
        """The folder's projection; None when it has none (no previews)."""
        path = Path(model_dir) / PROJECTION_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        factor = int(data.get("factor", 1))
        weight = torch.tensor(data["weight"], dtype=torch.float32)
        bias = torch.tensor(data["bias"], dtype=torch.float32)
        outputs = 3 * factor * factor
        if (weight.ndim != 4 or weight.shape[0] != outputs or bias.shape != (outputs,)
                or weight.shape[2] != weight.shape[3] or weight.shape[2] % 2 == 0):
            raise ValueError(f"{path}: weight must be [3 * factor², channels, k, k] (k odd) "
                             "and bias [3 * factor²]")
        return cls(weight, bias, factor)

    @property
    def name(self) -> str:
        return "projection"

    def to(self, device: torch.device) -> Projection:
        """The projection with its weights on `device` (moved once, not at every preview)."""
        return replace(self, weight=self.weight.to(device), bias=self.bias.to(device))

    @property
    def kernel(self) -> int:
        return int(self.weight.shape[-1])

    def to_rgb(self, grid: torch.Tensor, size: int = 0) -> torch.Tensor:
        """Latents [channels, h, w] -> rgb [3, h * factor, w * factor] in [0, 1] (float32, on
        their device); the whole grid whatever `size` (a convolution costs next to nothing)."""
        pad = self.kernel // 2
        padded = F.pad(grid.float()[None], (pad,) * 4, mode="replicate")
        blocks = F.conv2d(padded, self.weight.to(grid.device), self.bias.to(grid.device))
        return F.pixel_shuffle(blocks, self.factor)[0].clamp(0.0, 1.0)


def fit_projection(latents: torch.Tensor, pixels: torch.Tensor, factor: int,
                   kernel: int = DEFAULT_KERNEL) -> Projection:
    """Least squares (ridge) over every latent pixel: its kernel x kernel neighbourhood of
    latents [n, channels, h, w] (as the DiT holds them) against its block of the pictures they
    encode, rgb in [0, 1] [n, 3, H, W] resized to [h * factor, w * factor]."""
    _, channels, height, width = latents.shape
    f, pad = factor, kernel // 2
    target = F.interpolate(pixels.float(), size=(height * f, width * f), mode="area")
    y = F.pixel_unshuffle(target, f).permute(0, 2, 3, 1).reshape(-1, 3 * f * f)
    windows = F.unfold(F.pad(latents.float(), (pad,) * 4, mode="replicate"), kernel)
    x = windows.permute(0, 2, 1).reshape(-1, channels * kernel * kernel)
    x = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    solution = torch.linalg.solve(x.T @ x + RIDGE * torch.eye(x.shape[1]), x.T @ y)
    weight = solution[:-1].T.reshape(3 * f * f, channels, kernel, kernel)
    return Projection(weight.contiguous(), solution[-1].contiguous(), f)


_HISTOGRAMS: weakref.WeakKeyDictionary[CollectorRegistry, Histogram] = (
    weakref.WeakKeyDictionary())
_HISTOGRAMS_LOCK = threading.Lock()


def preview_histogram(registry: CollectorRegistry = REGISTRY) -> Histogram:
    """stagemesh_preview_seconds: one family per registry, shared by its stages."""
    with _HISTOGRAMS_LOCK:
        histogram = _HISTOGRAMS.get(registry)
        if histogram is None:
            histogram = Histogram(
                "stagemesh_preview_seconds",
                "Time of one step preview in the DiT (x0, painter, resize, copy to host)",
                buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1),
                registry=registry)
            _HISTOGRAMS[registry] = histogram
        return histogram


def check_options(options: PreviewOptions | None, painter: Painter | None) -> None:
    """A request's preview options against what the stage offers (InvalidInputError naming
    `preview`)."""
    if options is None:
        return
    if painter is None:
        raise InvalidInputError("preview", "this model makes no previews: its VAE is too large "
                                f"to decode them and its folder has no {PROJECTION_FILE}")
    if options.every < MIN_PREVIEW_EVERY:
        raise InvalidInputError("preview", f"preview.every must be at least {MIN_PREVIEW_EVERY}")
    if not 1 <= options.size <= MAX_PREVIEW_SIZE:
        raise InvalidInputError("preview", f"preview.size must be in [1, {MAX_PREVIEW_SIZE}]")


@dataclass
class Previewer:
    """One request's previews: its options, the folder's painter, its schedule's sigmas, and how
    its latents become a [channels, h, w] grid (Qwen-Image unpacks its 2x2 patches; Wan takes
    the middle frame)."""

    options: PreviewOptions
    painter: Painter
    sigmas: torch.Tensor  # the request's schedule, one per step (then the terminal one)
    grid: Callable[[torch.Tensor], torch.Tensor]
    histogram: Histogram

    def after(self, step_index: int, latents: torch.Tensor,
              velocity: torch.Tensor) -> Preview | None:
        """The preview due after step `step_index` (1-based), from the step's input latents and
        velocity; None when none is due or it failed (a preview never fails its request)."""
        if step_index % self.options.every:
            return None
        started = time.perf_counter()
        try:
            x0 = latents - self.sigmas[step_index - 1].to(latents.device, latents.dtype) * velocity
            rgb = self.painter.to_rgb(self.grid(x0), self.options.size)
            pixels = _resized(rgb, self.options.size)
        except Exception:
            logger.exception("preview after step %d failed", step_index)
            return None
        self.histogram.observe(time.perf_counter() - started)
        return Preview(step_index, pixels)


def _resized(rgb: torch.Tensor, size: int) -> npt.NDArray[np.uint8]:
    """rgb [3, h, w] in [0, 1] -> uint8 [H, W, 3], its long side `size` (aspect kept)."""
    height, width = rgb.shape[1:]
    scale = size / max(height, width)
    shape = (max(1, round(height * scale)), max(1, round(width * scale)))
    resized = F.interpolate(rgb[None], size=shape, mode="bilinear", align_corners=False)[0]
    as_bytes = (resized * 255).round().to(torch.uint8).permute(1, 2, 0)
    return np.ascontiguousarray(as_bytes.cpu().numpy())
