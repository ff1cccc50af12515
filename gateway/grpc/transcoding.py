"""Native REST routes derived from GatewayService's google.api.http annotations.

The proto is the one source of truth for paths, verbs and bodies: each annotated RPC becomes a
Starlette route that parses JSON (strictly: unknown fields are a 400 naming the field) plus
path and query parameters into the request message, calls the same in-process NativeApi method
the gRPC servicer calls, and answers JSON (server-streaming RPCs answer NDJSON, one message a
line; an error after the first line is a last line holding the error body).
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from google.api import annotations_pb2
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stagemesh.gateway.core import RequestContext
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.grpc.native import NativeApi
from stagemesh.gateway.wire.requests import (
    MAX_BODY_BYTES,
    REQUEST_ID_HEADER,
    TEXT_BODY_BYTES,
    off_loop,
    owner,
    parse_json_object,
    read_body,
    request_id,
)
from stagemesh.gateway.wire.streams import Payload, ndjson_response
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GatewayService"]
_TEMPLATE_VAR = re.compile(r"\{([^}=]+)(=[^}]*)?\}")
#: Where json_format's ParseError messages name the field, the top-level one first (a nested
#: error reads "Failed to parse audio field: ... has no field named "x" ...": `audio`).
_PARSE_ERROR_FIELD = (re.compile(r"^Failed to parse (\w+) field"),
                      re.compile(r'has no field named "([^"]*)"'),  # "" is a name too
                      re.compile(r" at [\w.]*\.(\w+)"))

MessageT = TypeVar("MessageT", bound=Message)
ReplyT = TypeVar("ReplyT", bound=Message)
Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class HttpBinding:
    """One google.api.http annotation: RPC name, HTTP verb, Starlette path, body rule."""

    rpc: str
    verb: str
    path: str
    body: str  # "*": the whole body is the message; "": fields come from query and path


def http_bindings() -> list[HttpBinding]:
    """Every annotated RPC of GatewayService, in proto order."""
    bindings = []
    for method in SERVICE.methods:
        options = method.GetOptions()
        if not options.HasExtension(annotations_pb2.http):
            continue
        rule = options.Extensions[annotations_pb2.http]
        verb = str(rule.WhichOneof("pattern"))
        template = str(getattr(rule, verb))
        bindings.append(HttpBinding(rpc=method.name, verb=verb.upper(),
                                    path=_TEMPLATE_VAR.sub(r"{\1}", template),
                                    body=str(rule.body)))
    return bindings


def to_json(message: Message) -> dict[str, object]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def parse_error_field(message: str) -> str | None:
    """The field a json_format.ParseError message names, if any."""
    for pattern in _PARSE_ERROR_FIELD:
        if match := pattern.search(message):
            return match.group(1)
    return None


async def parse_message(request: Request, binding: HttpBinding,
                        message_type: type[MessageT]) -> MessageT:
    """The request message from body, path and query (strict JSON; a large body is parsed in
    a worker thread, see wire/requests.off_loop)."""
    raw = await read_body(request, body_limit(binding.rpc)) if binding.body == "*" else b""
    given: dict[str, object] = {} if binding.body == "*" else dict(request.query_params)
    given.update(request.path_params)
    return await off_loop(len(raw), lambda: _message(raw, given, message_type))


@functools.cache
def body_limit(rpc: str) -> int:
    """A native route's body cap, read off its request message: MAX_BODY_BYTES where the
    message can carry binary (a bytes field: an image, a reference clip), else
    TEXT_BODY_BYTES."""
    request = SERVICE.methods_by_name[rpc].input_type
    return MAX_BODY_BYTES if _carries_bytes(request, set()) else TEXT_BODY_BYTES


def _carries_bytes(descriptor: Descriptor, seen: set[str]) -> bool:
    seen.add(descriptor.full_name)
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_BYTES:
            return True
        nested = field.message_type
        if nested is not None and nested.full_name not in seen and _carries_bytes(nested, seen):
            return True
    return False


def _message(raw: bytes, given: dict[str, object], message_type: type[MessageT]) -> MessageT:
    fields: dict[str, object] = {**parse_json_object(raw), **given} if raw else given
    message = message_type()
    descriptor = message.DESCRIPTOR
    known = {f.name for f in descriptor.fields} | {f.json_name for f in descriptor.fields}
    for name in fields:  # named here exactly (json_format's message quotes it unescaped)
        if name not in known:
            raise InvalidRequest(name, f"{descriptor.name} has no field named {name!r}")
    try:
        json_format.ParseDict(fields, message, ignore_unknown_fields=False)
    except json_format.ParseError as error:
        raise InvalidRequest(parse_error_field(str(error)), str(error)) from None
    return message


def _context(request: Request) -> RequestContext:
    """Native routes: the x-request-id id unless the message names its own; no timeout."""
    return RequestContext.create(request_id(request), None, owner(request))


def unary_endpoint(binding: HttpBinding, message_type: type[MessageT],
                   call: Callable[[MessageT, RequestContext], Awaitable[ReplyT]],
                   names_request: Callable[[MessageT, Request], None] | None = None,
                   request_id_of: Callable[[ReplyT], str] | None = None) -> Endpoint:
    """`names_request` fills the message's own id from the request (before the call);
    `request_id_of` is the reply's id, which the response's x-request-id then echoes."""
    async def endpoint(request: Request) -> Response:
        message = await parse_message(request, binding, message_type)
        if names_request is not None:
            names_request(message, request)
        reply = await call(message, _context(request))
        if request_id_of is not None:
            request.scope["state"]["request_id"] = request_id_of(reply)
        return JSONResponse(to_json(reply))

    return endpoint


def _job_id_from_header(message: pb.CreateVideoRequest, request: Request) -> None:
    """A video job's id is the body's `request_id`, else the client's own x-request-id (as
    POST /v1/videos), else a new one (NativeApi.CreateVideo)."""
    if not message.request_id:
        message.request_id = request.headers.get(REQUEST_ID_HEADER, "")


def _job_id(job: pb.VideoJob) -> str:
    return job.id


def stream_endpoint(
    binding: HttpBinding, message_type: type[MessageT],
    call: Callable[[MessageT, RequestContext], AsyncGenerator[ReplyT, None]],
) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        message = await parse_message(request, binding, message_type)
        replies = call(message, _context(request))
        try:  # errors before the first message still get their HTTP status
            first = await anext(replies, None)
        except BaseException:
            await replies.aclose()
            raise
        return ndjson_response(_lines(first, replies))

    return endpoint


async def _lines(first: Message | None,
                 replies: AsyncGenerator[Message, None]) -> AsyncGenerator[Payload, None]:
    try:
        if first is not None:
            yield to_json(first)
            async for reply in replies:
                yield to_json(reply)
    finally:
        await replies.aclose()  # client gone or done: stop the work behind it


def route_order(bindings: list[HttpBinding]) -> list[HttpBinding]:
    """Custom methods first (`/v1/videoJobs/{id}:watch`): Starlette tries routes in order, and
    `/v1/videoJobs/{id}` would otherwise take `x:watch` as an id. Otherwise proto order."""
    return sorted(bindings, key=lambda b: ":" not in b.path.rsplit("}", 1)[-1])


def annotated_routes(api: NativeApi) -> list[Route]:
    """One route per google.api.http-annotated GatewayService method, bound to `api`."""
    endpoints: dict[str, Callable[[HttpBinding], Endpoint]] = {
        "GenerateImage": lambda b: stream_endpoint(b, pb.GenerateImageRequest,
                                                   api.GenerateImage),
        "EditImage": lambda b: stream_endpoint(b, pb.EditImageRequest, api.EditImage),
        "CreateVideo": lambda b: unary_endpoint(b, pb.CreateVideoRequest, api.CreateVideo,
                                                _job_id_from_header, _job_id),
        "GetVideo": lambda b: unary_endpoint(b, pb.GetVideoRequest, api.GetVideo),
        "ListVideos": lambda b: unary_endpoint(b, pb.ListVideosRequest, api.ListVideos),
        "DeleteVideo": lambda b: unary_endpoint(b, pb.DeleteVideoRequest, api.DeleteVideo),
        "WatchVideo": lambda b: stream_endpoint(b, pb.WatchVideoRequest, api.WatchVideo),
        "DownloadVideo": lambda b: stream_endpoint(b, pb.DownloadVideoRequest,
                                                   api.DownloadVideo),
        "SynthesizeSpeech": lambda b: stream_endpoint(b, pb.SynthesizeSpeechRequest,
                                                      api.SynthesizeSpeech),
        "TranscribeAudio": lambda b: stream_endpoint(b, pb.TranscribeAudioRequest,
                                                     api.TranscribeAudio),
        "Chat": lambda b: stream_endpoint(b, pb.ChatRequest, api.Chat),
        "CancelRequest": lambda b: unary_endpoint(b, pb.CancelRequestRequest,
                                                  api.CancelRequest),
        "ListStages": lambda b: unary_endpoint(b, pb.ListStagesRequest, api.ListStages),
        "ListRecipes": lambda b: unary_endpoint(b, pb.ListRecipesRequest, api.ListRecipes),
    }
    routes = []
    for binding in route_order(http_bindings()):
        if binding.rpc not in endpoints:
            raise RuntimeError(f"GatewayService.{binding.rpc} is annotated for REST but "
                               "NativeApi has no endpoint for it")
        routes.append(Route(binding.path, endpoints[binding.rpc](binding),
                            methods=[binding.verb], name=f"native.{binding.rpc}"))
    return routes
