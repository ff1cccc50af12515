"""The tensor codecs (torch for the stages, numpy for the gateway): exact round trips on one
wire format, and every malformed message refused."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch

from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.tensors import (
    TensorDecodeError,
    array_from_proto,
    array_to_proto,
    check_message,
    is_set,
)
from stagemesh.shared.torch_tensors import (
    from_proto,
    optional_from_proto,
    optional_to_proto,
    to_proto,
)


@pytest.mark.parametrize("tensor", [
    torch.randn(2, 3, 4),
    torch.randn(5).to(torch.bfloat16),
    torch.randn(3, 2).to(torch.float16),
    torch.arange(12, dtype=torch.int64).reshape(3, 4),
    torch.tensor([1, -2, 3], dtype=torch.int16),
    torch.randint(0, 255, (4, 4, 3), dtype=torch.uint8),
    torch.tensor([True, False]),
    torch.tensor(3.5),
    torch.zeros(0, 7),
])
def test_round_trip_is_exact(tensor: torch.Tensor) -> None:
    decoded = from_proto(to_proto(tensor))
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_non_contiguous_input_round_trips_in_logical_order() -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    assert torch.equal(from_proto(to_proto(tensor)), tensor)


def test_decoded_tensor_is_writable_and_independent_of_the_message() -> None:
    message = to_proto(torch.ones(4))
    decoded = from_proto(message)
    decoded += 1
    assert torch.equal(from_proto(message), torch.ones(4))


def test_wire_bytes_are_little_endian_raw_values() -> None:
    message = to_proto(torch.tensor([1, 256], dtype=torch.int32))
    assert message.dtype == common_pb2.DTYPE_INT32
    assert list(message.shape) == [2]
    assert message.data == b"\x01\x00\x00\x00\x00\x01\x00\x00"


MALFORMED = [
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2], data=b"\x00" * 7), "needs 8"),
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\x00"), "dtype"),
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_UINT8, shape=[-1], data=b""), "negative"),
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_UINT8, shape=[1 << 20, 1 << 20], data=b""),
     "exceeds"),
    (common_pb2.Tensor(dtype=common_pb2.Dtype.ValueType(99), shape=[1], data=b"\x00"),
     "unsupported dtype 99"),
]


@pytest.mark.parametrize(("message", "match"), MALFORMED)
def test_malformed_messages_are_refused(message: common_pb2.Tensor, match: str) -> None:
    with pytest.raises(TensorDecodeError, match=match):
        from_proto(message)


def test_optional_fields() -> None:
    assert optional_from_proto(common_pb2.Tensor()) is None
    assert optional_to_proto(None) is None
    message = optional_to_proto(torch.ones(2))
    assert message is not None
    decoded = optional_from_proto(message)
    assert decoded is not None and torch.equal(decoded, torch.ones(2))


def test_unsupported_dtype_is_refused_on_encode() -> None:
    with pytest.raises(TypeError, match="complex"):
        to_proto(torch.zeros(2, dtype=torch.complex64))


# -- the numpy codec (shared.tensors), on the same wire ----------------------------------------



ARRAYS = [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
    np.array([0.5, -2.25, 65504.0], dtype=np.float16),
    np.array([[1, -(2**40)], [2**62, 0]], dtype=np.int64),
    np.array([1, -2, 2**31 - 1], dtype=np.int32),
    np.array([1, -2, 3], dtype=np.int16),
    np.arange(48, dtype=np.uint8).reshape(4, 4, 3),
    np.array([True, False, True]),
    np.array(3.5, dtype=np.float32),
    np.zeros((0, 7), dtype=np.float32),
]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_numpy_round_trip_is_exact(array: npt.NDArray[np.generic]) -> None:
    decoded = array_from_proto(array_to_proto(array))
    assert decoded.dtype == array.dtype
    assert decoded.shape == array.shape
    assert np.array_equal(decoded, array)


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_numpy_and_torch_write_the_same_wire(array: npt.NDArray[np.generic]) -> None:
    tensor = torch.from_numpy(array.copy())
    assert array_to_proto(array) == to_proto(tensor)
    assert torch.equal(from_proto(array_to_proto(array)), tensor)
    assert np.array_equal(array_from_proto(to_proto(tensor)), array)


def test_numpy_big_endian_and_non_contiguous_arrays_travel_in_logical_order() -> None:
    big_endian = np.array([1.5, -2.0, 256.0], dtype=">f4")
    message = array_to_proto(big_endian)
    assert message.dtype == common_pb2.DTYPE_FLOAT32
    assert message.data == np.array([1.5, -2.0, 256.0], dtype="<f4").tobytes()
    transposed = np.arange(6, dtype=np.int32).reshape(2, 3).T
    assert np.array_equal(array_from_proto(array_to_proto(transposed)), transposed)


def test_numpy_decoded_array_is_writable_and_independent_of_the_message() -> None:
    message = array_to_proto(np.ones(4, dtype=np.float32))
    decoded = array_from_proto(message)
    decoded[:] = 2
    assert np.array_equal(array_from_proto(message), np.ones(4, dtype=np.float32))


def test_array_from_proto_refuses_bfloat16() -> None:
    message = to_proto(torch.ones(3, dtype=torch.bfloat16))
    assert check_message(message).shape == (3,)  # a valid message, just not one numpy reads
    with pytest.raises(TensorDecodeError, match="bfloat16"):
        array_from_proto(message)


@pytest.mark.parametrize("dtype", [np.float64, np.complex64, np.uint16, np.int8])
def test_numpy_dtypes_without_a_wire_dtype_are_refused_on_encode(dtype: type) -> None:
    with pytest.raises(TypeError, match="cannot send arrays of dtype"):
        array_to_proto(np.zeros(2, dtype=dtype))


@pytest.mark.parametrize(("message", "match"), MALFORMED)
def test_array_from_proto_refuses_malformed_messages(
    message: common_pb2.Tensor, match: str
) -> None:
    with pytest.raises(TensorDecodeError, match=match):
        array_from_proto(message)


def test_size_limit_is_a_parameter() -> None:
    message = array_to_proto(np.zeros(10, dtype=np.uint8))
    assert array_from_proto(message, max_elements=10).shape == (10,)
    with pytest.raises(TensorDecodeError, match="limit of 9"):
        array_from_proto(message, max_elements=9)


def test_is_set_tells_an_unset_field_from_an_empty_tensor() -> None:
    assert not is_set(common_pb2.Tensor())
    assert is_set(array_to_proto(np.zeros(0, dtype=np.float32)))
