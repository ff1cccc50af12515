"""The tensor codec: exact round trips, and every malformed message refused."""

from __future__ import annotations

import pytest
import torch

from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.tensors import TensorDecodeError
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


@pytest.mark.parametrize(("message", "match"), [
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2], data=b"\x00" * 7), "needs 8"),
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\x00"), "dtype"),
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_UINT8, shape=[-1], data=b""), "negative"),
    (common_pb2.Tensor(dtype=common_pb2.DTYPE_UINT8, shape=[1 << 20, 1 << 20], data=b""),
     "exceeds"),
])
def test_malformed_messages_are_refused(message: common_pb2.Tensor, match: str) -> None:
    with pytest.raises(TensorDecodeError, match=match):
        from_proto(message)


def test_optional_fields() -> None:
    assert optional_from_proto(common_pb2.Tensor()) is None
    assert optional_to_proto(None) is None
    assert torch.equal(optional_from_proto(optional_to_proto(torch.ones(2))), torch.ones(2))


def test_unsupported_dtype_is_refused_on_encode() -> None:
    with pytest.raises(TypeError, match="complex"):
        to_proto(torch.zeros(2, dtype=torch.complex64))
