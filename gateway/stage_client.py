"""Calling one stage for one request: a bidi stream owned by the request's CancelScope, on
the replica the stage's ReplicaSet picks (gateway/balancer.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Generic, Literal, Never, Protocol, TypeVar

import grpc

from stagemesh.gateway.balancer import CONNECT_TIMEOUT_S, Replica, RoutedStreamStream
from stagemesh.gateway.cancel import CancelScope, OpenCall, RequestCancelled
from stagemesh.shared.control import OWNER_METADATA_KEY
from stagemesh.shared.errors import StageError, parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.tracing import outgoing_metadata, traced_stage_call

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
    """A stage call failed; `error` holds the gRPC code, message and bad field; `replica` the
    replica's address when the call reached one."""

    def __init__(self, stage: str, error: StageError, replica: str = "") -> None:
        super().__init__(f"{stage} stage: {error.message}")
        self.stage = stage
        self.error = error
        self.replica = replica


class _Refused(Exception):
    """The stage refused the start before accepting it (it drains, or its queue is full):
    the call may go to another replica."""

    def __init__(self, error: StageError) -> None:
        super().__init__(error.message)
        self.error = error


#: ErrorInfo reasons of a stage that refused a start without accepting it (stage_stream's
#: FAULT_STATUS): the request never ran there, so another replica may take it.
REFUSED_REASONS = frozenset({"DRAINING", "QUEUE_FULL"})


def _refusal(error: StageError) -> bool:
    return error.reason in REFUSED_REASONS and error.code in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@traced_stage_call
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

    A stage of several replicas (`rpc` from a balancer.ReplicaChannel) gets the call on its
    least-loaded ready replica; a start refused before the stage accepted it (no connection,
    draining, queue full, or cancelled by a server that stops) goes to the next replica, each
    replica once. A request never runs
    on two replicas: once a start is sent on a live connection, any other failure is final.
    """
    call = _Call(scope, stage, start, cancel_message, request_id, on_event, pump_inputs)
    if not isinstance(rpc, RoutedStreamStream):
        try:
            return await call.run(rpc)
        except _Refused as refused:
            raise StageCallError(stage, refused.error) from None
    return await _call_routed(call, rpc)


async def _call_routed(call: _Call[RequestT, ResponseT],
                       rpc: RoutedStreamStream[RequestT, ResponseT]) -> ResponseT:
    """`call` on the least-loaded replica that accepts it (see call_stage)."""
    replicas, tried = rpc.replicas, list[Replica]()
    last = StageError(grpc.StatusCode.UNAVAILABLE,
                      f"no replica of the {call.stage} stage at {replicas.address}")
    while (replica := replicas.take(tried)) is not None:
        tried.append(replica)
        left = call.scope.remaining()
        try:
            if not await replicas.connect(replica,
                                          min(CONNECT_TIMEOUT_S, left or CONNECT_TIMEOUT_S)):
                replicas.mark_down(replica)
                last = StageError(grpc.StatusCode.UNAVAILABLE,
                                  f"could not connect to replica {replica.address}")
                continue
            return await call.run(rpc.on(replica), replica.address)
        except _Refused as refused:
            replicas.mark_refusing(replica)
            last = refused.error
        except StageCallError as failed:
            if failed.error.code is grpc.StatusCode.UNAVAILABLE:
                replicas.mark_down(replica)
            raise
        finally:
            replicas.release(replica)
    raise StageCallError(call.stage, last, tried[-1].address if tried else "")


class _Call(Generic[RequestT, ResponseT]):
    """One stage call of a request, run on one replica by `run` (again on another replica
    after a refusal)."""

    def __init__(self, scope: CancelScope, stage: str, start: RequestT,
                 cancel_message: CancelMessage[RequestT], request_id: str | None,
                 on_event: OnEvent[ResponseT] | None,
                 pump_inputs: PumpInputs[RequestT, ResponseT] | None) -> None:
        self.scope, self.stage, self.start = scope, stage, start
        self.cancel_message = cancel_message
        self.on_event, self.pump_inputs = on_event, pump_inputs
        metadata = [("x-request-id", request_id or scope.stage_request_id), *outgoing_metadata()]
        if scope.owner:
            metadata.append((OWNER_METADATA_KEY, scope.owner))
        self.metadata = tuple(metadata)

    async def run(self, rpc: grpc.aio.StreamStreamMultiCallable[RequestT, ResponseT],
                  replica: str = "") -> ResponseT:
        """The call on one replica; raises _Refused if the stage refused the start."""
        call = rpc(timeout=self.scope.remaining(), metadata=self.metadata)

        async def send_cancel(reason: str) -> None:
            await call.write(self.cancel_message(cancel=common_pb2.Cancel(reason=reason)))

        pump: asyncio.Task[None] | None = None
        opened: OpenCall | None = None
        answered = False  # the stage sent an event: it accepted the start
        try:
            await call.write(self.start)
            opened = self.scope.enter_stage(self.stage, send_cancel)
            if self.pump_inputs is not None:
                pump = asyncio.create_task(self.pump_inputs(call))
            async for response in call:
                kind = response.WhichOneof("event")
                if kind == "result":
                    return response
                if kind == "aborted":
                    self._aborted(response.aborted, answered, replica)
                answered = True
                if self.on_event is not None:
                    await self.on_event(self.stage, response)
            raise StageCallError(self.stage, StageError(
                grpc.StatusCode.INTERNAL, "stage stream ended without a result"), replica)
        except grpc.aio.AioRpcError as failed:
            error = parse_rpc_error(failed)
            if not answered and _refusal(error):
                raise _Refused(error) from None
            if not answered and self._cut_unseen(error):
                raise _Refused(StageError(
                    grpc.StatusCode.UNAVAILABLE, f"replica {replica or '(unknown)'} stopped "
                    f"before it accepted the start ({error.message})")) from None
            raise StageCallError(self.stage, error, replica) from None
        finally:
            if opened is not None:
                self.scope.leave_stage(opened)
            if pump is not None:
                pump.cancel()
            call.cancel()

    def _cut_unseen(self, error: StageError) -> bool:
        """The stream ended before any event, without a word from the stage: a CANCELLED this
        gateway did not ask for, or UNAVAILABLE with no reason of the stage's. That is what
        gRPC gives a stream that reaches a server as it stops (a replica ending its drain),
        before a handler saw it, or one sent as the connection went away. An admitted
        request's first event is `queued`, and a draining stage stops its server only after
        its engines stopped, so the start did not run there and may go to another replica."""
        if error.code is grpc.StatusCode.CANCELLED:
            return not self.scope.cancel_requested
        return error.code is grpc.StatusCode.UNAVAILABLE and not error.reason

    def _aborted(self, aborted: common_pb2.Aborted, answered: bool, replica: str) -> Never:
        """The stage ended the request with `aborted`: a cancel's acknowledgement, or the
        replica shutting down (then the request failed there: UNAVAILABLE, or a refusal when
        it never started)."""
        if aborted.reason != common_pb2.ABORT_REASON_SHUTDOWN or self.scope.cancel_requested:
            raise RequestCancelled(self.scope.acknowledge(self.stage, aborted))
        error = StageError(grpc.StatusCode.UNAVAILABLE,
                           f"replica {replica or '(unknown)'} shut down before the request "
                           f"finished (after {aborted.step_index} steps)", "DRAINING")
        if not answered:
            raise _Refused(error)
        raise StageCallError(self.stage, error, replica)
