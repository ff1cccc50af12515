"""A public gRPC request that does not decode is INVALID_ARGUMENT naming the field, not UNKNOWN.

grpc-python decodes a request before any handler runs, and a decode failure (a string field
holding bad UTF-8, truncated bytes) ends the call as UNKNOWN: a server error for what is the
client's mistake. This interceptor wraps each GatewayService handler's deserializer so that a
failure becomes a value the handler answers as INVALID_ARGUMENT, naming the string field with
bad UTF-8 when there is one (found by walking the wire format: linear in the message).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from stagemesh.shared.errors import build_status
from stagemesh.shared.interception import HandlerInterceptor
from stagemesh.shared.proto.v1 import gateway_service_pb2

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
Context = grpc.aio.ServicerContext[object, object]
SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"]
#: Wire types of the protobuf encoding (the ones a proto3 message uses).
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
#: Nested messages deeper than this are not searched for the bad field.
MAX_SEARCH_DEPTH = 8


@dataclass(frozen=True)
class Undecodable:
    """A request that did not decode: the handler refuses it."""

    field_name: str | None
    message: str


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError("truncated varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def bad_utf8_field(raw: bytes, descriptor: Descriptor, depth: int = 0) -> str | None:
    """The top-level field of a `descriptor` message whose string (or nested string) is not
    UTF-8, or None (not found, or the bytes are not a message at all)."""
    pos = 0
    try:
        while pos < len(raw):
            key, pos = _varint(raw, pos)
            number, wire = key >> 3, key & 7
            if wire == VARINT:
                _, pos = _varint(raw, pos)
            elif wire in (FIXED64, FIXED32):
                pos += 8 if wire == FIXED64 else 4
            elif wire == LENGTH_DELIMITED:
                length, pos = _varint(raw, pos)
                chunk, pos = raw[pos:pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is not None and _holds_bad_utf8(chunk, field, depth):
                    return field.name
            else:
                return None
    except ValueError:
        return None
    return None


def _holds_bad_utf8(chunk: bytes, field: FieldDescriptor, depth: int) -> bool:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return True
        return False
    nested = field.message_type
    if field.type == FieldDescriptor.TYPE_MESSAGE and nested and depth < MAX_SEARCH_DEPTH:
        return bad_utf8_field(chunk, nested, depth + 1) is not None
    return False


def _tolerant(deserialize: Callable[[bytes], object],
              descriptor: Descriptor) -> Callable[[bytes], object]:
    def tolerant(raw: bytes) -> object:
        try:
            return deserialize(raw)
        except DecodeError as error:
            field_name = bad_utf8_field(raw, descriptor)
            what = f"{field_name} is not valid UTF-8" if field_name else str(error)
            return Undecodable(field_name, f"the request message does not decode: {what}")

    return tolerant


async def _refuse(context: Context, request: Undecodable) -> None:
    await context.abort_with_status(build_status(
        grpc.StatusCode.INVALID_ARGUMENT, request.message, reason="INVALID_ARGUMENT",
        field_name=request.field_name or "request"))


def _unary_unary(behavior: Callable[[object, Context], Awaitable[object]]
                 ) -> Callable[[object, Context], Awaitable[object]]:
    async def handle(request: object, context: Context) -> object:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)

    return handle


def _unary_stream(behavior: Callable[[object, Context], AsyncIterator[object]]
                  ) -> Callable[[object, Context], AsyncIterator[object]]:
    async def handle(request: object, context: Context) -> AsyncIterator[object]:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        async for response in behavior(request, context):
            yield response

    return handle


class DecodeErrorInterceptor(HandlerInterceptor):
    """Wraps every GatewayService handler (unary requests: all of them) as the module says."""

    def intercept(self, handler: grpc.RpcMethodHandler[RequestT, ResponseT] | None,
                  handler_call_details: grpc.HandlerCallDetails,
                  ) -> grpc.RpcMethodHandler[RequestT, ResponseT] | None:
        service, _, name = handler_call_details.method.lstrip("/").partition("/")
        method = SERVICE.methods_by_name.get(name) if service == SERVICE.full_name else None
        if (handler is None or method is None or method.input_type is None
                or handler.request_streaming or handler.request_deserializer is None):
            return handler
        deserialize = _tolerant(handler.request_deserializer, method.input_type)
        # types-grpcio declares handlers as sync functions of RequestT; under grpc.aio they
        # are coroutine / async generator functions, and the request may be Undecodable.
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _unary_stream(handler.unary_stream),  # type: ignore[arg-type]
                request_deserializer=deserialize,  # type: ignore[arg-type]
                response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_unary(handler.unary_unary),  # type: ignore[arg-type]
                request_deserializer=deserialize,  # type: ignore[arg-type]
                response_serializer=handler.response_serializer)
        return handler
