"""numpy.ndarray <-> stagemesh.v1.Tensor, without pickle and without torch.

A tensor travels as dtype + shape + raw little-endian bytes. This module owns the wire rules
(which dtypes exist, how many bytes a shape needs, the size limit) and the numpy codec the
gateway uses; `stagemesh.shared.torch_tensors` is the stages' torch codec on the same rules.
bfloat16 has no numpy dtype: stages that send to the gateway send dtypes numpy reads.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stagemesh.shared.proto.v1 import common_pb2

assert sys.byteorder == "little", "the wire format is little-endian; add byte swapping first"

#: Refuse tensors larger than this many elements (a hostile shape must not allocate memory).
MAX_ELEMENTS = 256 * 1024 * 1024

#: Bytes per element of every wire dtype.
ITEMSIZE: dict[common_pb2.Dtype.ValueType, int] = {
    common_pb2.DTYPE_FLOAT32: 4,
    common_pb2.DTYPE_FLOAT16: 2,
    common_pb2.DTYPE_BFLOAT16: 2,
    common_pb2.DTYPE_INT64: 8,
    common_pb2.DTYPE_INT32: 4,
    common_pb2.DTYPE_INT16: 2,
    common_pb2.DTYPE_UINT8: 1,
    common_pb2.DTYPE_BOOL: 1,
}

#: The numpy dtype of each wire dtype numpy can represent (all but bfloat16).
_NUMPY: dict[common_pb2.Dtype.ValueType, np.dtype[np.generic]] = {
    common_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    common_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    common_pb2.DTYPE_INT64: np.dtype("<i8"),
    common_pb2.DTYPE_INT32: np.dtype("<i4"),
    common_pb2.DTYPE_INT16: np.dtype("<i2"),
    common_pb2.DTYPE_UINT8: np.dtype("u1"),
    common_pb2.DTYPE_BOOL: np.dtype("?"),
}
_FROM_NUMPY: dict[np.dtype[np.generic], common_pb2.Dtype.ValueType] = {
    v: k for k, v in _NUMPY.items()
}


class TensorDecodeError(ValueError):
    """The proto does not describe a valid tensor."""


@dataclass(frozen=True)
class WireLayout:
    """What a checked Tensor message holds: its dtype enum and shape."""

    dtype: common_pb2.Dtype.ValueType
    shape: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.shape)


def check_message(message: common_pb2.Tensor, *, max_elements: int = MAX_ELEMENTS) -> WireLayout:
    """Validate dtype, shape, size limit and byte count; raise TensorDecodeError otherwise."""
    itemsize = ITEMSIZE.get(message.dtype)
    if itemsize is None:
        raise TensorDecodeError(f"unsupported dtype {message.dtype}")
    shape = tuple(int(dim) for dim in message.shape)
    if any(dim < 0 for dim in shape):
        raise TensorDecodeError(f"negative dimension in shape {shape}")
    layout = WireLayout(message.dtype, shape)
    if layout.count > max_elements:
        raise TensorDecodeError(
            f"tensor of {layout.count} elements exceeds the limit of {max_elements}"
        )
    if len(message.data) != layout.count * itemsize:
        raise TensorDecodeError(
            f"shape {shape} of dtype {common_pb2.Dtype.Name(message.dtype)} needs "
            f"{layout.count * itemsize} bytes, got {len(message.data)}"
        )
    return layout


def array_to_proto(array: npt.NDArray[np.generic]) -> common_pb2.Tensor:
    """Encode a numpy array (any layout) as a Tensor message."""
    dtype = _FROM_NUMPY.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">"
                            else array.dtype)
    if dtype is None:
        raise TypeError(f"cannot send arrays of dtype {array.dtype}")
    raw = np.ascontiguousarray(array, dtype=_NUMPY[dtype]).tobytes()
    return common_pb2.Tensor(dtype=dtype, shape=list(array.shape), data=raw)


def array_from_proto(
    message: common_pb2.Tensor, *, max_elements: int = MAX_ELEMENTS
) -> npt.NDArray[np.generic]:
    """Decode a Tensor message into a writable array that owns its memory."""
    layout = check_message(message, max_elements=max_elements)
    numpy_dtype = _NUMPY.get(layout.dtype)
    if numpy_dtype is None:
        raise TensorDecodeError("bfloat16 tensors have no numpy dtype; decode them with torch")
    return np.frombuffer(message.data, dtype=numpy_dtype).reshape(layout.shape).copy()


def is_set(message: common_pb2.Tensor) -> bool:
    """Whether an optional Tensor field carries a tensor (its dtype is specified)."""
    return message.dtype != common_pb2.DTYPE_UNSPECIFIED
