"""The one bidi-stream handler every stage servicer delegates to.

A stage stream is: first client message `start` -> engine.submit; later client messages `input`
(engine.add_input) or `cancel` (engine.abort); server messages mirror the engine's events
(`progress` and `preempted` only where the stage's response has that event). What differs per
stage (message classes, how payloads are built and encoded) is a `StageWire`.

The handler has four jobs, one function each: check the start message (`_check_start`), submit
it (`_submit`), forward the messages that follow (`_ClientReader`), and turn engine events into
responses (`_to_response`, with the stream's end in `_end_of_stream`). Every error status comes
from one table, `FAULT_STATUS`.

Cancellation: an explicit `cancel` ends the stream with an `aborted` event; a passed deadline ends
it with DEADLINE_EXCEEDED; a cancelled RPC (the client went away) cancels this handler, and its
`finally` aborts the request in the engine, which drops it at once if it waits or at its next
step if it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, Literal, Never, Protocol, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message

from stagemesh.shared.control import owner_from_metadata
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InputT,
    InvalidInputError,
    PartialT,
    ResultT,
    StateT,
    StreamT,
)
from stagemesh.shared.engine.engine import (
    EngineClosed,
    QueueFullError,
    RequestStream,
    StepEngine,
)
from stagemesh.shared.engine.events import (
    Completed,
    Event,
    Failed,
    Partial,
    Preempted,
    Progress,
    Queued,
    Terminal,
    is_terminal,
)
from stagemesh.shared.engine.request import AbortReason
from stagemesh.shared.errors import abort_with
from stagemesh.shared.limits import MAX_STAGE_REQUEST_ID_CHARS, REQUEST_ID_PATTERN
from stagemesh.shared.logs import request_id_var
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.stage_trace import OFF, StageTrace, start_stage_trace
from stagemesh.shared.tensors import TensorDecodeError

log = logging.getLogger(__name__)

ABORT_REASON_TO_PROTO = {
    AbortReason.CANCELLED: common_pb2.ABORT_REASON_CANCELLED,
    AbortReason.RPC_CANCELLED: common_pb2.ABORT_REASON_CLIENT_GONE,
    AbortReason.DEADLINE_EXCEEDED: common_pb2.ABORT_REASON_DEADLINE_EXCEEDED,
    AbortReason.SHUTDOWN: common_pb2.ABORT_REASON_SHUTDOWN,
}


class StartMessage(Protocol):
    """What every stage's `start` message has."""

    @property
    def request_id(self) -> str: ...


class ClientMessage(Protocol):
    """What every stage's client message has: a `kind` oneof of start | cancel (| input).

    The generated request classes (`DenoiseRequest`, `DecodeAudioRequest`, ...) match it.
    """

    @property
    def start(self) -> StartMessage: ...

    @property
    def cancel(self) -> common_pb2.Cancel: ...

    def WhichOneof(self, oneof_group: Literal["kind"]) -> str | None: ...


RequestT = TypeVar("RequestT", bound=ClientMessage)
ResponseT = TypeVar("ResponseT", bound=Message)

#: A bad value from the client: a field that fails a check, or a tensor that does not decode.
InputError = InvalidInputError | TensorDecodeError


@dataclass(frozen=True)
class StageWire(Generic[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT]):
    """How one stage RPC maps onto the engine; its types are the RPC's and the adapter's.

    make_request: the first client message (kind `start`) + absolute deadline (monotonic) ->
      EngineRequest; raises InvalidInputError / TensorDecodeError for bad input.
    encode_result: the adapter's `finish` result -> the response's `result` message.
    encode_partial: a StepOutput.partial -> a whole response; None = the stage has no partials.
    make_input: a client message of kind `input` -> payload for engine.add_input; None = no
      streamed input.
    """

    response_cls: type[ResponseT]
    make_request: Callable[[RequestT, float | None], EngineRequest[InputT]]
    encode_result: Callable[[ResultT], Message]
    encode_partial: Callable[[PartialT], ResponseT] | None = None
    make_input: Callable[[RequestT], StreamT] | None = None

    def has_field(self, name: str) -> bool:
        return name in self.response_cls.DESCRIPTOR.fields_by_name

    @property
    def rpc_name(self) -> str:
        """The RPC's name (`Denoise` for DenoiseResponse): the stage's server span name."""
        return self.response_cls.DESCRIPTOR.name.removesuffix("Response")

    def respond(self, field_name: str, message: Message) -> ResponseT:
        """A response whose event oneof holds `message` in `field_name`."""
        return self.response_cls(**{field_name: message})


# -- errors: every way a stream ends with a status, and the one table of their codes ----------


class Fault(enum.Enum):
    """Why a stage stream ends with an error status instead of a terminal event."""

    MISSING_START = enum.auto()  # the first message is not `start`
    BAD_ARGUMENT = enum.auto()  # the start (or a streamed input) is invalid
    QUEUE_FULL = enum.auto()  # the engine holds max_pending requests
    DRAINING = enum.auto()  # the engine admits nothing new (shutting down, or stopped)
    FAILED_ON_INPUT = enum.auto()  # the request failed on a named input field
    FAILED = enum.auto()  # the request failed inside the stage
    DEADLINE_EXCEEDED = enum.auto()  # the RPC's deadline passed


#: The one table from a fault to its gRPC status code and ErrorInfo reason.
FAULT_STATUS: dict[Fault, tuple[grpc.StatusCode, str]] = {
    Fault.MISSING_START: (grpc.StatusCode.INVALID_ARGUMENT, "MISSING_START"),
    Fault.BAD_ARGUMENT: (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    Fault.QUEUE_FULL: (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL"),
    Fault.DRAINING: (grpc.StatusCode.UNAVAILABLE, "DRAINING"),
    Fault.FAILED_ON_INPUT: (grpc.StatusCode.INVALID_ARGUMENT, "STAGE_FAILED"),
    Fault.FAILED: (grpc.StatusCode.INTERNAL, "STAGE_FAILED"),
    Fault.DEADLINE_EXCEEDED: (grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
}


class StreamError(Exception):
    """Ends the stream with the status FAULT_STATUS gives `fault`."""

    def __init__(self, fault: Fault, message: str, field_name: str | None = None) -> None:
        super().__init__(message)
        self.fault = fault
        self.message = message
        self.field_name = field_name

    @classmethod
    def bad_argument(cls, error: InputError, default_field: str) -> StreamError:
        field_name = error.field_name if isinstance(error, InvalidInputError) else default_field
        return cls(Fault.BAD_ARGUMENT, str(error), field_name)


async def _abort(
    context: grpc.aio.ServicerContext[RequestT, ResponseT], error: StreamError
) -> Never:
    code, reason = FAULT_STATUS[error.fault]
    await abort_with(context, code, error.message, reason=reason, field_name=error.field_name)


# -- the start: check it, submit it ---------------------------------------------------------


def _check_start(first: RequestT | None) -> RequestT:
    """The first client message, if it is a start with a valid request id; else StreamError."""
    if first is None or first.WhichOneof("kind") != "start":
        raise StreamError(Fault.MISSING_START,
                          "the first message on a stage stream must be `start`", "start")
    request_id = first.start.request_id
    if not request_id or len(request_id) > MAX_STAGE_REQUEST_ID_CHARS:
        raise StreamError(Fault.BAD_ARGUMENT,
                          f"request_id must be 1..{MAX_STAGE_REQUEST_ID_CHARS} characters",
                          "request_id")
    if not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise StreamError(Fault.BAD_ARGUMENT, "request_id may hold only ASCII letters, digits "
                          "and . _ : -", "request_id")
    return first


def _submit(
    engine: StepEngine[InputT, StreamT, StateT, PartialT, ResultT],
    wire: StageWire[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT],
    start: RequestT,
    deadline: float | None,
    owner: str = "",
) -> RequestStream[PartialT, ResultT]:
    try:
        return engine.submit(wire.make_request(start, deadline), owner)
    except (InvalidInputError, TensorDecodeError) as error:
        raise StreamError.bad_argument(error, "start") from error
    except QueueFullError as error:
        raise StreamError(Fault.QUEUE_FULL, str(error)) from error
    except EngineClosed as error:  # a gateway retries it on another replica
        raise StreamError(Fault.DRAINING, str(error)) from error


def _owner_of(context: grpc.aio.ServicerContext[RequestT, ResponseT]) -> str:
    """Who may cancel the request by id from another gateway (shared/control.py)."""
    return owner_from_metadata(context.invocation_metadata())


def _deadline_of(context: grpc.aio.ServicerContext[RequestT, ResponseT]) -> float | None:
    remaining: float | None = context.time_remaining()  # None when the call has no deadline
    return None if remaining is None else time.monotonic() + remaining


# -- the messages after the start -------------------------------------------------------------


class _ClientReader(Generic[RequestT, StreamT]):
    """Forwards the `input` and `cancel` messages that follow `start` to the engine, in a task.

    Undecodable input stops the request and is kept in `bad_input`, so the stream then ends
    with INVALID_ARGUMENT instead of waiting forever for input that will never come.
    """

    def __init__(
        self,
        engine: StepEngine[InputT, StreamT, StateT, PartialT, ResultT],
        make_input: Callable[[RequestT], StreamT] | None,
        request_id: str,
        requests: AsyncIterator[RequestT],
    ) -> None:
        self.bad_input: StreamError | None = None
        self._abort = engine.abort
        self._add_input = engine.add_input
        self._make_input = make_input
        self._request_id = request_id
        self._task = asyncio.create_task(self._forward(requests))

    async def _forward(self, requests: AsyncIterator[RequestT]) -> None:
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "cancel":
                log.info("cancel received: %s", message.cancel.reason or "no reason given")
                self._abort(self._request_id, AbortReason.CANCELLED)
            elif kind == "input" and self._make_input is not None:
                try:
                    payload = self._make_input(message)
                except (InvalidInputError, TensorDecodeError) as error:
                    self.bad_input = StreamError.bad_argument(error, "input")
                    self._abort(self._request_id, AbortReason.CANCELLED)
                    return
                self._add_input(self._request_id, payload)
            else:
                log.warning("ignoring unexpected %r message after start", kind)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


# -- events to responses ----------------------------------------------------------------------


def _to_response(
    wire: StageWire[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT],
    event: Event[PartialT, ResultT],
    bad_input: StreamError | None,
) -> ResponseT | None:
    """The response for one engine event; None for events this RPC does not carry."""
    if isinstance(event, Queued):
        return wire.respond("queued", common_pb2.Queued(position=event.position))
    if isinstance(event, Progress):
        if not wire.has_field("progress"):
            return None
        return wire.respond("progress", common_pb2.Progress(
            step_index=event.step_index, total_steps=event.total_steps or 0,
            step_seconds=event.step_seconds, elapsed_seconds=event.elapsed_seconds))
    if isinstance(event, Preempted):
        if not wire.has_field("preempted"):
            return None
        return wire.respond("preempted", common_pb2.Preempted(step_index=event.step_index))
    if isinstance(event, Partial):
        return None if wire.encode_partial is None else wire.encode_partial(event.payload)
    return _end_of_stream(wire, event, bad_input)


def _end_of_stream(
    wire: StageWire[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT],
    event: Terminal[ResultT],
    bad_input: StreamError | None,
) -> ResponseT:
    """The last response of a stream; raises StreamError for the endings that are a status."""
    if isinstance(event, Completed):
        return wire.respond("result", wire.encode_result(event.result))
    if isinstance(event, Failed):
        fault = Fault.FAILED_ON_INPUT if event.field_name else Fault.FAILED
        raise StreamError(fault, event.message, event.field_name)
    if bad_input is not None:  # this handler aborted the request because of bad input
        raise bad_input
    if event.reason is AbortReason.DEADLINE_EXCEEDED:
        raise StreamError(Fault.DEADLINE_EXCEEDED,
                          f"deadline passed after {event.step_index} steps")
    return wire.respond("aborted", common_pb2.Aborted(
        step_index=event.step_index, reason=ABORT_REASON_TO_PROTO[event.reason],
        abort_latency_seconds=event.abort_latency_seconds))


# -- the loop ---------------------------------------------------------------------------------


@dataclass
class OpenStreams:
    """The stage streams of one engine whose handler runs, and when the last one opened: a
    draining stage keeps its server up until they end (shared/stage_runtime.py)."""

    count: int = 0
    last_opened: float = -math.inf  # time.monotonic()


_open_streams: weakref.WeakKeyDictionary[object, OpenStreams] = weakref.WeakKeyDictionary()


def open_streams(engine: object) -> OpenStreams:
    """The stage streams open on `engine` (a StepEngine)."""
    return _open_streams.setdefault(engine, OpenStreams())


async def serve_stage_stream(
    engine: StepEngine[InputT, StreamT, StateT, PartialT, ResultT],
    wire: StageWire[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT],
    requests: AsyncIterator[RequestT],
    context: grpc.aio.ServicerContext[RequestT, ResponseT],
) -> AsyncIterator[ResponseT]:
    """Run one bidi stage stream to its terminal event (see the module docstring), counted in
    `open_streams(engine)` while it runs."""
    streams = open_streams(engine)
    streams.count += 1
    streams.last_opened = time.monotonic()
    try:
        async with contextlib.aclosing(_serve(engine, wire, requests, context)) as responses:
            async for response in responses:
                yield response
    finally:
        streams.count -= 1


async def _serve(
    engine: StepEngine[InputT, StreamT, StateT, PartialT, ResultT],
    wire: StageWire[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT],
    requests: AsyncIterator[RequestT],
    context: grpc.aio.ServicerContext[RequestT, ResponseT],
) -> AsyncGenerator[ResponseT, None]:
    trace: StageTrace = OFF  # its trace (shared/stage_trace.py): a no-op while traces are off
    try:
        start = _check_start(await anext(requests, None))
        request_id = start.start.request_id
        request_id_var.set(request_id)
        trace = start_stage_trace(wire.rpc_name, request_id, context.invocation_metadata)
        stream = _submit(engine, wire, start, _deadline_of(context), _owner_of(context))
    except StreamError as error:
        trace.end(error.message)
        await _abort(context, error)

    reader = _ClientReader(engine, wire.make_input, request_id, requests)
    ended = False
    try:
        async for event in stream:
            ended = is_terminal(event)
            trace.observe(event)
            response = _to_response(wire, event, reader.bad_input)
            if response is not None:
                yield response
    except StreamError as error:
        trace.end(error.message)
        await _abort(context, error)
    finally:
        await reader.close()
        if not ended:  # the RPC was cancelled or its deadline passed: stop the work now
            engine.abort(request_id, AbortReason.RPC_CANCELLED)
            trace.follow(stream)  # records the abort once the engine has made it, then ends
        else:
            trace.end()


#: One RPC's bidi stream handler: the client's messages and the call -> the server's messages.
StreamHandler: TypeAlias = Callable[
    [AsyncIterator[RequestT], grpc.aio.ServicerContext[RequestT, ResponseT]],
    AsyncIterator[ResponseT],
]


class StageRoute(Generic[RequestT, ResponseT, InputT, StreamT, StateT, PartialT, ResultT]):
    """One RPC served by one engine through its wire: a StreamHandler whose type says only the
    RPC's messages, so that one servicer serves every model family of its stage."""

    def __init__(self, engine: StepEngine[InputT, StreamT, StateT, PartialT, ResultT],
                 wire: StageWire[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT]
                 ) -> None:
        self.engine = engine
        self._make_wire: Callable[
            [], StageWire[RequestT, ResponseT, InputT, StreamT, PartialT, ResultT]
        ] = lambda: wire

    @classmethod
    def per_stream(
        cls, engine: StepEngine[InputT, StreamT, StateT, PartialT, ResultT],
        make_wire: Callable[[], StageWire[RequestT, ResponseT, InputT, StreamT, PartialT,
                                          ResultT]],
    ) -> StageRoute[RequestT, ResponseT, InputT, StreamT, StateT, PartialT, ResultT]:
        """A route whose every stream gets a new wire (one that numbers that stream's parts)."""
        route = cls(engine, make_wire())
        route._make_wire = make_wire
        return route

    def __call__(
        self, requests: AsyncIterator[RequestT],
        context: grpc.aio.ServicerContext[RequestT, ResponseT],
    ) -> AsyncIterator[ResponseT]:
        return serve_stage_stream(self.engine, self._make_wire(), requests, context)
