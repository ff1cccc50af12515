"""Causal VAE convolutions on one frame, computed as the 2-D convolutions they equal.

`AutoencoderKLQwenImage` (like Wan's) is a video VAE: every convolution is a causal 3-D one
whose temporal padding puts two zero frames before the first frame. An image is one frame, so
only the kernel's last temporal slice ever touches data, and the other two thirds of the work
multiply zeros. Running that slice as a 2-D convolution gives the same result (float rounding aside)
for about a third of the cost: measured on tiny-shapes' VAE, two 256x256 decodes on one thread
took 1.03 s through the 3-D path and 0.36 s through this one. Before it, the VAE's decodes cost
as much CPU as a third of the DiT's at 256 px, which capped what a second DiT replica could gain
(`stagemesh bench replicas`).

Frames after the first (a cached previous frame, `cache_x`), strided time and padding modes
other than zeros keep the stock path, so a video or a chunked encode is unchanged. The switch is
per module instance (`use_single_frame_convs`), not a patch of the diffusers class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

Forward = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def single_frame(conv: QwenImageCausalConv3d | WanCausalConv3d, stock: Forward) -> Forward:
    """`conv`'s forward: a lone first frame through `conv2d` with the kernel's last temporal
    slice, anything else through `stock`."""
    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[2] != 1 or cache_x is not None or conv.stride[0] != 1:
            return stock(x, cache_x)
        pad_w, _, pad_h = conv._padding[:3]
        if not isinstance(pad_w, int) or not isinstance(pad_h, int):  # a padding-mode string
            return stock(x, cache_x)
        weight = conv.weight[:, :, -1]
        return F.conv2d(x[:, :, 0], weight, conv.bias, conv.stride[1:], (pad_h, pad_w))[:, :, None]

    return forward


def use_single_frame_convs(module: torch.nn.Module) -> int:
    """Every causal convolution inside `module` takes the one-frame path from now on; the
    number of convolutions switched."""
    convs = [layer for layer in module.modules()
             if isinstance(layer, QwenImageCausalConv3d | WanCausalConv3d)]
    for conv in convs:
        conv.forward = single_frame(conv, conv.forward)  # type: ignore[method-assign,assignment]
    return len(convs)
