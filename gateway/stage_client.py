"""Calling one stage for one request: a bidi stream owned by the request's CancelScope."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Literal, Protocol, TypeVar

import grpc

from stagemesh.gateway.cancel import CancelScope, OpenCall, RequestCancelled
from stagemesh.shared.errors import StageError, parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2

RequestT = TypeVar("RequestT")
RequestT_co = TypeVar("RequestT_co", covariant=True)
ResponseT = TypeVar("ResponseT", bound="StageResponse")


class StageResponse(Protocol):
    """What every stage stream's server message has: a oneof `event` with `result` and
    `aborted` among its members (the generated messages match this)."""

    @property
    def aborted(self) -> common_pb2.Aborted: ...

    def WhichOneof(self, oneof_group: Literal["event"]) -> str | None: ...


class CancelMessage(Protocol[RequestT_co]):
    """A stage stream's client message class, built with `cancel=` (the generated classes)."""

    def __call__(self, *, cancel: common_pb2.Cancel | None = ...) -> RequestT_co: ...


#: Called for every non-terminal event (queued, progress, partial outputs) of a stage.
OnEvent = Callable[[str, ResponseT], Awaitable[None]]
#: Writes `input` messages on an open call (streamed input, e.g. frames for the codec).
PumpInputs = Callable[[grpc.aio.StreamStreamCall[RequestT, ResponseT]],
                      Coroutine[object, object, None]]


class StageCallError(Exception):
    """A stage call failed; `error` holds the gRPC code, message and bad field."""

    def __init__(self, stage: str, error: StageError) -> None:
        super().__init__(f"{stage} stage: {error.message}")
        self.stage = stage
        self.error = error


async def call_stage(
    scope: CancelScope,
    stage: str,
    rpc: grpc.aio.StreamStreamMultiCallable[RequestT, ResponseT],
    start: RequestT,
    cancel_message: CancelMessage[RequestT],
    *,
    request_id: str | None = None,
    on_event: OnEvent[ResponseT] | None = None,
    pump_inputs: PumpInputs[RequestT, ResponseT] | None = None,
) -> ResponseT:
    """Run one stage stream to its result; return the response that carries it (`.result`).

    `start` is the stream's first message; `cancel_message` is the stream's client message
    class (it builds the Cancel message); `request_id` is the id `start` gives the stage, when
    it is not the scope's own (a sub-id). Raises RequestCancelled when the stage acknowledges
    a cancel, StageCallError on a gRPC error. If the surrounding task is cancelled (client
    gone), the call is cancelled too, and the stage aborts the request at once. pump_inputs,
    if given, runs alongside the reader.
    """
    call = rpc(timeout=scope.remaining(),
               metadata=(("x-request-id", request_id or scope.request_id),))

    async def send_cancel(reason: str) -> None:
        await call.write(cancel_message(cancel=common_pb2.Cancel(reason=reason)))

    pump: asyncio.Task[None] | None = None
    opened: OpenCall | None = None
    try:
        await call.write(start)
        opened = scope.enter_stage(stage, send_cancel)
        if pump_inputs is not None:
            pump = asyncio.create_task(pump_inputs(call))
        async for response in call:
            kind = response.WhichOneof("event")
            if kind == "result":
                return response
            if kind == "aborted":
                raise RequestCancelled(scope.acknowledge(stage, response.aborted))
            if on_event is not None:
                await on_event(stage, response)
        raise StageCallError(stage, StageError(grpc.StatusCode.INTERNAL,
                                               "stage stream ended without a result"))
    except grpc.aio.AioRpcError as error:
        raise StageCallError(stage, parse_rpc_error(error)) from None
    finally:
        if opened is not None:
            scope.leave_stage(opened)
        if pump is not None:
            pump.cancel()
        call.cancel()
