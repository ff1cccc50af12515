"""torch.Tensor <-> stagemesh.v1.Tensor, without pickle.

A tensor travels as dtype + shape + raw little-endian bytes. Encoding makes one copy (into the
bytes field); decoding makes one copy (into a writable buffer torch owns), so a decoded tensor is
safe to modify in place.
"""

from __future__ import annotations

import math
import sys

import torch

from stagemesh.shared.proto.v1 import common_pb2

assert sys.byteorder == "little", "the wire format is little-endian; add byte swapping first"

_TO_PROTO: dict[torch.dtype, int] = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.int64: common_pb2.DTYPE_INT64,
    torch.int32: common_pb2.DTYPE_INT32,
    torch.int16: common_pb2.DTYPE_INT16,
    torch.uint8: common_pb2.DTYPE_UINT8,
    torch.bool: common_pb2.DTYPE_BOOL,
}
_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}

#: Refuse tensors larger than this many elements (a hostile shape must not allocate memory).
MAX_ELEMENTS = 256 * 1024 * 1024


class TensorDecodeError(ValueError):
    """The proto does not describe a valid tensor."""


def to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Encode a CPU tensor (any layout) as a Tensor message."""
    if tensor.dtype not in _TO_PROTO:
        raise TypeError(f"cannot send tensors of dtype {tensor.dtype}")
    flat = tensor.detach().to("cpu").contiguous()
    # Reinterpret as bytes without going through numpy, which lacks bfloat16.
    raw = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return common_pb2.Tensor(dtype=_TO_PROTO[flat.dtype], shape=list(flat.shape), data=raw)


def from_proto(message: common_pb2.Tensor, *, max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """Decode a Tensor message; raise TensorDecodeError on any inconsistency."""
    dtype = _FROM_PROTO.get(message.dtype)
    if dtype is None:
        raise TensorDecodeError(f"unsupported dtype {message.dtype}")
    shape = tuple(message.shape)
    if any(dim < 0 for dim in shape):
        raise TensorDecodeError(f"negative dimension in shape {shape}")
    count = math.prod(shape)
    if count > max_elements:
        raise TensorDecodeError(f"tensor of {count} elements exceeds the limit of {max_elements}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(message.data) != count * itemsize:
        raise TensorDecodeError(
            f"shape {shape} of {dtype} needs {count * itemsize} bytes, got {len(message.data)}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)


def optional_from_proto(message: common_pb2.Tensor) -> torch.Tensor | None:
    """Decode a Tensor field that may be unset (dtype unspecified)."""
    return from_proto(message) if message.dtype != common_pb2.DTYPE_UNSPECIFIED else None


def optional_to_proto(tensor: torch.Tensor | None) -> common_pb2.Tensor | None:
    """Encode a tensor that may be absent (None leaves the field unset)."""
    return to_proto(tensor) if tensor is not None else None
