"""Weight quantization of a stage's model (the DiT's transformer blocks, the text encoder),
through torchao: the stage option `quantization`.

- `none`: the weights as loaded.
- `int8`: int8 weights, activations in the stage's dtype (`Int8WeightOnlyConfig`): on this
  CPU the tiny DiT's step ran 1.02x float32 with it and 7.1x with dynamic int8 activations
  (`Int8DynamicActivationInt8WeightConfig`, whose CPU path quantizes every activation per
  call), alternating in one process; it also halves (bf16) or quarters (fp32) weight memory.
- `fp8`: fp8 weights and dynamic fp8 activations (`Float8DynamicActivationFloat8WeightConfig`),
  only on a CUDA device with fp8 kernels (compute capability 8.9+); anywhere else the stage
  stops at start with a message naming the option.

Only `torch.nn.Linear` layers are quantized (they hold nearly every weight of a transformer);
what runs between them (norms, attention, rotary embeddings) stays in the stage's dtype.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from typing import TypedDict

import torch

#: The least CUDA compute capability with fp8 matmuls (Ada, Hopper).
FP8_MIN_CAPABILITY = (8, 9)
#: The option's name (one owner: messages and Describe name it through this).
OPTION = "quantization"


class Quantization(enum.Enum):
    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"


class QuantizationOptions(TypedDict, total=False):
    """A stage's quantization option (published in Describe)."""

    quantization: str  # none | int8 | fp8


class _DropMissingKernels(logging.Filter):
    """torchao warns at import that its CUDA (cutlass) extensions do not load on a CPU build:
    expected here, not an operator's concern."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load")


logging.getLogger("torchao").addFilter(_DropMissingKernels())


def from_options(stage: str, options: QuantizationOptions, device: torch.device) -> Quantization:
    """The option, checked against the device the stage runs on; ValueError naming the option
    for an unknown value or one the device cannot run."""
    name = options.get(OPTION, Quantization.NONE.value)
    methods = {method.value: method for method in Quantization}
    if name not in methods:
        raise ValueError(f"stage {stage}: option {OPTION} must be one of {sorted(methods)}, "
                         f"got {name!r}")
    method = methods[name]
    if method is Quantization.FP8 and not has_fp8(device):
        raise ValueError(
            f"stage {stage}: option {OPTION}=fp8 needs a CUDA device with fp8 kernels "
            f"(compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+); this stage "
            f"runs on {device}: use {OPTION}=int8 or none")
    return method


def has_fp8(device: torch.device) -> bool:
    """Whether `device` has fp8 matmuls."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY)


def quantize(modules: Iterable[torch.nn.Module], method: Quantization) -> None:
    """Quantize the Linear layers of `modules` in place (nothing for `none`)."""
    if method is Quantization.NONE:
        return
    # imported here: torchao's import costs seconds, and a stage without the option skips it
    from torchao.quantization import quantize_

    config = _config(method)
    for module in modules:
        quantize_(module, config, filter_fn=_is_linear)


def _config(method: Quantization) -> object:
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8WeightOnlyConfig,
    )

    configs: dict[Quantization, Callable[[], object]] = {
        Quantization.INT8: Int8WeightOnlyConfig,
        Quantization.FP8: Float8DynamicActivationFloat8WeightConfig,
    }
    return configs[method]()


def _is_linear(module: torch.nn.Module, name: str) -> bool:
    return isinstance(module, torch.nn.Linear)
