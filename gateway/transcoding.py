"""Native REST routes derived from GatewayService's google.api.http annotations.

The proto is the one source of truth: each annotated RPC becomes a Starlette route that parses
JSON (strictly: unknown fields are a 400) into the request message, calls the gateway's own gRPC
server over loopback, and answers JSON (server-streaming RPCs answer NDJSON, one message a line).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.api import annotations_pb2
from google.protobuf import descriptor, json_format, message_factory
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stagemesh.gateway.errors import http_status
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import gateway_service_pb2

SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"]
MAX_BODY_BYTES = 32 * 1024 * 1024
_TEMPLATE_VAR = re.compile(r"\{([^}=]+)(=[^}]*)?\}")


def _to_json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _error_response(code: grpc.StatusCode, message: str, field_name: str | None) -> JSONResponse:
    return JSONResponse({"error": {"code": code.name, "message": message,
                                   "field": field_name}}, status_code=http_status(code))


async def _parse(request: Request, rule: Any, input_cls: type[Message]) -> Message:
    """Build the request message from body, path and query (strict JSON)."""
    fields: dict[str, Any] = {}
    if rule.body == "*":
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise json_format.ParseError(f"body larger than {MAX_BODY_BYTES} bytes")
        try:
            fields = json.loads(raw) if raw else {}
        except json.JSONDecodeError as error:
            raise json_format.ParseError(f"body is not JSON: {error}") from None
        if not isinstance(fields, dict):
            raise json_format.ParseError("body must be a JSON object")
    else:
        fields.update(request.query_params)
    fields.update(request.path_params)
    message = input_cls()
    json_format.ParseDict(fields, message, ignore_unknown_fields=False)
    return message


def _endpoint(method: descriptor.MethodDescriptor, rule: Any,
              channel: Callable[[], grpc.aio.Channel]) -> Callable[[Request], Any]:
    input_cls = message_factory.GetMessageClass(method.input_type)
    output_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{SERVICE.full_name}/{method.name}"

    async def endpoint(request: Request) -> Response:
        try:
            message = await _parse(request, rule, input_cls)
        except json_format.ParseError as error:
            return _error_response(grpc.StatusCode.INVALID_ARGUMENT, str(error), None)
        if not method.server_streaming:
            call = channel().unary_unary(path, request_serializer=input_cls.SerializeToString,
                                         response_deserializer=output_cls.FromString)
            try:
                return JSONResponse(_to_json(await call(message)))
            except grpc.aio.AioRpcError as failed:
                error = parse_rpc_error(failed)
                return _error_response(error.code, error.message, error.field_name)
        stream = channel().unary_stream(path, request_serializer=input_cls.SerializeToString,
                                        response_deserializer=output_cls.FromString)(message)
        try:  # surface errors before the first message as a proper HTTP status
            first = await stream.read()
        except grpc.aio.AioRpcError as failed:
            error = parse_rpc_error(failed)
            return _error_response(error.code, error.message, error.field_name)
        return StreamingResponse(_ndjson(first, stream), media_type="application/x-ndjson")

    return endpoint


async def _ndjson(first: Any, stream: Any) -> AsyncIterator[bytes]:
    try:
        message = first
        while message is not grpc.aio.EOF:  # read() only: the call must not mix in iteration
            yield (json.dumps(_to_json(message)) + "\n").encode()
            message = await stream.read()
    except grpc.aio.AioRpcError as failed:  # status is already 200: end with an error line
        error = parse_rpc_error(failed)
        yield (json.dumps({"error": {"code": error.code.name, "message": error.message,
                                     "field": error.field_name}}) + "\n").encode()
    finally:
        stream.cancel()  # client gone or done: stop the work behind it


def annotated_routes(channel: Callable[[], grpc.aio.Channel]) -> list[Route]:
    """One route per google.api.http-annotated GatewayService method."""
    routes = []
    for method in SERVICE.methods:
        options = method.GetOptions()
        if not options.HasExtension(annotations_pb2.http):
            continue
        rule = options.Extensions[annotations_pb2.http]
        verb = rule.WhichOneof("pattern")
        template = getattr(rule, verb)
        routes.append(Route(_TEMPLATE_VAR.sub(r"{\1}", template), _endpoint(method, rule, channel),
                            methods=[verb.upper()], name=f"native.{method.name}"))
    return routes
