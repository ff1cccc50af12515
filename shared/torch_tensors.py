"""torch.Tensor <-> stagemesh.v1.Tensor for the stages, on the wire rules of `shared.tensors`.

Encoding makes one copy (into the bytes field); decoding makes one copy (into a writable buffer
torch owns), so a decoded tensor is safe to modify in place. bfloat16 travels as raw bytes.
"""

from __future__ import annotations

import torch

from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.tensors import MAX_ELEMENTS, check_message, is_set

_TO_PROTO: dict[torch.dtype, common_pb2.Dtype.ValueType] = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.int64: common_pb2.DTYPE_INT64,
    torch.int32: common_pb2.DTYPE_INT32,
    torch.int16: common_pb2.DTYPE_INT16,
    torch.uint8: common_pb2.DTYPE_UINT8,
    torch.bool: common_pb2.DTYPE_BOOL,
}
_FROM_PROTO: dict[common_pb2.Dtype.ValueType, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}


def to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Encode a tensor (any device, any layout) as a Tensor message."""
    if tensor.dtype not in _TO_PROTO:
        raise TypeError(f"cannot send tensors of dtype {tensor.dtype}")
    flat = tensor.detach().to("cpu").contiguous()
    # Reinterpret as bytes without going through numpy's dtypes, which lack bfloat16.
    raw = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return common_pb2.Tensor(dtype=_TO_PROTO[flat.dtype], shape=list(flat.shape), data=raw)


def from_proto(message: common_pb2.Tensor, *, max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """Decode a Tensor message; raise TensorDecodeError on any inconsistency."""
    layout = check_message(message, max_elements=max_elements)
    dtype = _FROM_PROTO[layout.dtype]
    if layout.count == 0:
        return torch.empty(layout.shape, dtype=dtype)
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(layout.shape)


def optional_from_proto(message: common_pb2.Tensor) -> torch.Tensor | None:
    """Decode a Tensor field that may be unset (dtype unspecified)."""
    return from_proto(message) if is_set(message) else None


def optional_to_proto(tensor: torch.Tensor | None) -> common_pb2.Tensor | None:
    """Encode a tensor that may be absent (None leaves the field unset)."""
    return to_proto(tensor) if tensor is not None else None
