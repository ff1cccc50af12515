"""The one bidi-stream handler every stage servicer delegates to.

A stage stream is: first client message `start` -> engine.submit; later client messages `input`
(engine.add_input) or `cancel` (engine.abort); server messages mirror the engine's events. What
differs per stage (message classes, how payloads are built and encoded) is a `StageWire`.

Cancellation: an explicit `cancel` ends the stream with an `aborted` event; a passed deadline ends
it with DEADLINE_EXCEEDED; a cancelled RPC (the client went away) cancels this handler, and the
`finally` below aborts the request in the engine, which drops it at once if it waits or at its next
step if it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError
from stagemesh.shared.engine.engine import QueueFullError, StepEngine
from stagemesh.shared.engine.events import Aborted, Completed, Failed, Partial, Progress, Queued
from stagemesh.shared.engine.request import AbortReason
from stagemesh.shared.errors import abort_with
from stagemesh.shared.logs import request_id_var
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.tensors import TensorDecodeError

log = logging.getLogger(__name__)

ABORT_REASON_TO_PROTO = {
    AbortReason.CANCELLED: common_pb2.ABORT_REASON_CANCELLED,
    AbortReason.RPC_CANCELLED: common_pb2.ABORT_REASON_CLIENT_GONE,
    AbortReason.DEADLINE_EXCEEDED: common_pb2.ABORT_REASON_DEADLINE_EXCEEDED,
    AbortReason.SHUTDOWN: common_pb2.ABORT_REASON_SHUTDOWN,
}

#: Longest request id a stage accepts.
MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class StageWire:
    """How one stage RPC maps onto the engine.

    make_request: start message + absolute deadline (monotonic) -> EngineRequest; raises
      InvalidInputError / TensorDecodeError for bad input.
    encode_result: the adapter's `finish` result -> the response's `result` message.
    encode_partial: a StepOutput.partial -> (response field name, message); None = no partials.
    make_input: an `input` message -> payload for engine.add_input; None = no streamed input.
    """

    response_cls: type[Message]
    make_request: Callable[[Any, float | None], EngineRequest]
    encode_result: Callable[[Any], Message]
    encode_partial: Callable[[Any], tuple[str, Message]] | None = None
    make_input: Callable[[Any], Any] | None = None

    def has_field(self, name: str) -> bool:
        return name in self.response_cls.DESCRIPTOR.fields_by_name


def _deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def _read_client_messages(
    engine: StepEngine, wire: StageWire, request_id: str, requests: AsyncIterator[Any],
    bad_input: list[InvalidInputError | TensorDecodeError],
) -> None:
    """Forward `input` and `cancel` messages that follow `start` to the engine.

    Undecodable input stops the request (recorded in `bad_input`, so the stream then ends
    with INVALID_ARGUMENT instead of waiting forever for input that will never come).
    """
    async for message in requests:
        kind = message.WhichOneof("kind")
        if kind == "cancel":
            log.info("cancel received: %s", message.cancel.reason or "no reason given")
            engine.abort(request_id, AbortReason.CANCELLED)
        elif kind == "input" and wire.make_input is not None:
            try:
                payload = wire.make_input(message.input)
            except (InvalidInputError, TensorDecodeError) as error:
                bad_input.append(error)
                engine.abort(request_id, AbortReason.CANCELLED)
                return
            engine.add_input(request_id, payload)
        else:
            log.warning("ignoring unexpected %r message after start", kind)


def _event_to_response(wire: StageWire, event: Any) -> Message | None:
    cls = wire.response_cls
    if isinstance(event, Queued):
        return cls(queued=common_pb2.Queued(position=event.position))
    if isinstance(event, Progress):
        if not wire.has_field("progress"):
            return None
        return cls(progress=common_pb2.Progress(
            step_index=event.step_index, total_steps=event.total_steps or 0,
            step_seconds=event.step_seconds, elapsed_seconds=event.elapsed_seconds))
    if isinstance(event, Partial):
        if wire.encode_partial is None:
            return None
        name, message = wire.encode_partial(event.payload)
        return cls(**{name: message})
    if isinstance(event, Completed):
        return cls(result=wire.encode_result(event.result))
    if isinstance(event, Aborted):
        return cls(aborted=common_pb2.Aborted(
            step_index=event.step_index, reason=ABORT_REASON_TO_PROTO[event.reason],
            abort_latency_seconds=event.abort_latency_seconds))
    raise TypeError(f"unexpected engine event {event!r}")


async def serve_stage_stream(
    engine: StepEngine,
    wire: StageWire,
    requests: AsyncIterator[Any],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[Message]:
    """Run one bidi stage stream to its terminal event (see the module docstring)."""
    first = await anext(requests, None)
    if first is None or first.WhichOneof("kind") != "start":
        await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "the first message on a stage stream must be `start`",
                         reason="MISSING_START", field_name="start")
        return
    start = first.start
    if not start.request_id or len(start.request_id) > MAX_REQUEST_ID_CHARS:
        await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters",
                         reason="INVALID_ARGUMENT", field_name="request_id")
        return
    request_id_var.set(start.request_id)
    try:
        stream = engine.submit(wire.make_request(start, _deadline_of(context)))
    except (InvalidInputError, TensorDecodeError) as error:
        await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(error),
                         reason="INVALID_ARGUMENT",
                         field_name=getattr(error, "field_name", "start"))
        return
    except QueueFullError as error:
        await abort_with(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error),
                         reason="QUEUE_FULL")
        return

    bad_input: list[InvalidInputError | TensorDecodeError] = []
    reader = asyncio.create_task(
        _read_client_messages(engine, wire, start.request_id, requests, bad_input))
    terminal_seen = False
    try:
        async for event in stream:
            if isinstance(event, Aborted) and bad_input:
                terminal_seen = True
                await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(bad_input[0]),
                                 reason="INVALID_ARGUMENT",
                                 field_name=getattr(bad_input[0], "field_name", "input"))
            if isinstance(event, Failed):
                terminal_seen = True
                code = (grpc.StatusCode.INVALID_ARGUMENT if event.field_name
                        else grpc.StatusCode.INTERNAL)
                await abort_with(context, code, event.message, reason="STAGE_FAILED",
                                 field_name=event.field_name)
                return
            terminal_seen = isinstance(event, (Completed, Aborted))
            if isinstance(event, Aborted) and event.reason is AbortReason.DEADLINE_EXCEEDED:
                await abort_with(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"deadline passed after {event.step_index} steps",
                                 reason="DEADLINE_EXCEEDED")
            response = _event_to_response(wire, event)
            if response is not None:
                yield response
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        if not terminal_seen:
            # The RPC was cancelled or its deadline passed: stop the work now.
            engine.abort(start.request_id, AbortReason.RPC_CANCELLED)
