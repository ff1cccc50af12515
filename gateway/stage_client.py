"""Calling one stage for one request: a bidi stream owned by the request's CancelScope."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from stagemesh.gateway.cancel import CancelScope, RequestCancelled
from stagemesh.shared.errors import StageError, parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2

log = logging.getLogger(__name__)

#: stage name -> that stage's generated gRPC stub (see Mesh.stubs).
StubFor = Callable[[str], Any]

#: Called for every non-terminal event (queued, progress, partial outputs) of a stage.
OnEvent = Callable[[str, Message], Awaitable[None]]


class StageCallError(Exception):
    """A stage call failed; `error` holds the gRPC code, message and bad field."""

    def __init__(self, stage: str, error: StageError) -> None:
        super().__init__(f"{stage} stage: {error.message}")
        self.stage = stage
        self.error = error


async def call_stage(
    scope: CancelScope,
    stage: str,
    rpc: grpc.aio.StreamStreamMultiCallable,
    request_cls: type[Message],
    start: Message,
    *,
    on_event: OnEvent | None = None,
    pump_inputs: Callable[[Any], Awaitable[None]] | None = None,
) -> Message:
    """Run one stage stream to its result.

    Raises RequestCancelled when the stage acknowledges a cancel, StageCallError on a gRPC
    error. If the surrounding task is cancelled (client gone), the call is cancelled too, and
    the stage aborts the request at once.
    pump_inputs, if given, is started as `await pump_inputs(call)` alongside the reader: it
    writes `input` messages (streamed input, e.g. frames for the codec).
    """
    call = rpc(timeout=scope.remaining(), metadata=(("x-request-id", scope.request_id),))

    async def send_cancel(reason: str) -> None:
        await call.write(request_cls(cancel=common_pb2.Cancel(reason=reason)))

    pump = None
    try:
        await call.write(request_cls(start=start))
        scope.enter_stage(stage, send_cancel)
        if pump_inputs is not None:
            pump = asyncio.create_task(pump_inputs(call))
        async for response in call:
            kind = response.WhichOneof("event")
            if kind == "result":
                return response.result
            if kind == "aborted":
                raise RequestCancelled(scope.acknowledge(stage, response.aborted))
            if on_event is not None:
                await on_event(stage, response)
        raise StageCallError(stage, StageError(grpc.StatusCode.INTERNAL,
                                               "stage stream ended without a result"))
    except grpc.aio.AioRpcError as error:
        raise StageCallError(stage, parse_rpc_error(error)) from None
    finally:
        scope.leave_stage(stage)
        if pump is not None:
            pump.cancel()
        call.cancel()
