"""Stage calls and the per-request cancellation scope that owns them: one deadline, one owner
of every downstream call.

Triggers and what they do:
- client disconnect / gRPC cancel: the task running the request is cancelled; the open stage call
  is cancelled with it (the stage sees a cancelled RPC and aborts the request at once);
- explicit cancel by id (`cancel`): a Cancel message goes down every open stage stream (a
  request may hold several: speech's talker and codec, or the n images of an image request,
  each its own stage request under a sub-id), and the caller gets the first stage's
  acknowledgement (step reached, abort latency);
- deadline: every stage call gets `timeout = remaining budget`, so the stage drops the request
  itself when it passes (grpc-python does not propagate deadlines).
Once cancelled, no later stage is started for the request.

Requests and their ids belong to the owner (API key) that started them: two owners may run
requests of the same id at once. The registry keys scopes by (owner, id), and the stages know a
request by its owner-qualified id (`stage_request_id`), so their engines never mix the two up;
with API keys off (owner "") the stages see the client's id unchanged.

A stage call (`call_stage`, the second half) is one bidi stream of one request to one stage,
owned by the request's CancelScope, on the replica the stage's ReplicaSet picks (balancer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Generic, Literal, Never, Protocol, TypeAlias, TypeVar

import grpc

from stagemesh.gateway.mesh.balancer import CONNECT_TIMEOUT_S, Replica, RoutedStreamStream
from stagemesh.shared.control import OWNER_METADATA_KEY
from stagemesh.shared.errors import StageError, parse_rpc_error
from stagemesh.shared.limits import MAX_REQUEST_ID_CHARS, OWNER_ID_CHARS
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.tracing import outgoing_metadata, traced_stage_call

#: A common_pb2.RequestState value.
RequestState: TypeAlias = common_pb2.RequestState.ValueType

#: How long a cancel-by-id waits for the stage's acknowledgement.
CANCEL_ACK_TIMEOUT_S = 10.0


class RequestCancelled(Exception):
    """The request was cancelled by id; carries what the stage acknowledged."""

    def __init__(self, outcome: CancelOutcome) -> None:
        super().__init__(f"request cancelled in stage {outcome.stage or '(none)'}")
        self.outcome = outcome


class DeadlineExceeded(Exception):
    """The request's time budget ran out before a stage call could start."""


@dataclass(frozen=True)
class CancelOutcome:
    request_id: str
    state: RequestState
    stage: str = ""
    step_index: int = 0
    abort_latency_seconds: float = 0.0


SendCancel = Callable[[str], Awaitable[None]]


@dataclass(frozen=True, eq=False)
class OpenCall:
    """A stage call in progress for a request, and how to cancel it (compared by identity)."""

    stage: str
    send_cancel: SendCancel


def new_request_id() -> str:
    """An id for a request whose client chose none."""
    return f"req-{uuid.uuid4().hex}"


def stage_request_id(request_id: str, owner: str) -> str:
    """The id the stages know `owner`'s request `request_id` by: `<request_id>:<owner>`, or the
    id itself for owner "" (API keys off). Every owner id of an API key has the same length
    (shared/limits.OWNER_ID_CHARS, the most the stages make room for) and no '.', so the ids
    of two owners never meet at a stage, nor with a part's suffix added (`sub_request_id`)."""
    if not owner:
        return request_id
    if len(owner) > OWNER_ID_CHARS:
        raise ValueError(f"owner id {owner!r} is longer than {OWNER_ID_CHARS} characters")
    return f"{request_id}:{owner}"


def sub_request_id(request_id: str, index: int, parts: int) -> str:
    """The id the stages know part `index` of a request by: the request's own id when it has
    one part, else `<request_id>.<index>` (each image of an n > 1 request runs as its own
    stage request, so that the stages can run them side by side)."""
    return request_id if parts <= 1 else f"{request_id}.{index}"


def sub_request_ids(request_id: str, parts: int) -> list[str]:
    return [sub_request_id(request_id, index, parts) for index in range(parts)]


@contextlib.asynccontextmanager
async def side_by_side() -> AsyncIterator[asyncio.TaskGroup]:
    """A TaskGroup whose first failure cancels the other tasks (and so their open stage calls)
    and is raised as itself, not wrapped in an ExceptionGroup: the caller handles a request's
    failure the same way whether it ran one call or several."""
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None


class CancelScope:
    """Deadline and cancellation of one gateway request (see the module docstring)."""

    def __init__(self, request_id: str, timeout: float | None, parts: int = 1,
                 owner: str = "") -> None:
        #: The client's id: what responses, logs and cancel by id name the request by.
        self.request_id = request_id
        #: Who may cancel it by id: the API key's owner id ("" with API keys off). Stage calls
        #: carry it, so a cancel from another gateway stops it only for the same owner.
        self.owner = owner
        #: The id every stage start gives the stages (see `stage_request_id`).
        self.stage_request_id = stage_request_id(request_id, owner)
        #: The id each part (image) runs under in the stages; [stage_request_id] for one part.
        self.sub_request_ids = sub_request_ids(self.stage_request_id, parts)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.outcome: CancelOutcome | None = None
        self._open: list[OpenCall] = []  # every stage call in progress, oldest first
        self._cancel_requested = False
        self._settled = asyncio.Event()  # set once `outcome` is final

    def remaining(self) -> float | None:
        """Seconds left, for the next stage call's timeout; raises when none are left."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.request_id} ran out of time")
        return left

    def check(self, stage: str = "") -> None:
        """Raise RequestCancelled if a cancel arrived (call before work that is not a stage)."""
        if self.outcome is not None:
            raise RequestCancelled(self.outcome)
        if self._cancel_requested:
            raise RequestCancelled(self.acknowledge(stage, common_pb2.Aborted()))

    def enter_stage(self, stage: str, send_cancel: SendCancel) -> OpenCall:
        """Called once a stage call has started; returns the handle `leave_stage` takes. Raises
        if a cancel came first: the caller then cancels the call it just opened, and no later
        stage runs. Several calls may be open at once, to the same stage too."""
        self.check(stage)
        call = OpenCall(stage, send_cancel)
        self._open.append(call)
        return call

    def leave_stage(self, call: OpenCall) -> None:
        with contextlib.suppress(ValueError):  # left twice: nothing to do
            self._open.remove(call)

    @property
    def cancel_requested(self) -> bool:
        """A cancel by id reached this request (its stages may still be acknowledging)."""
        return self._cancel_requested or self.outcome is not None

    @property
    def open_stages(self) -> list[str]:
        """The stage of every call in progress, oldest first (a stage once per call)."""
        return [call.stage for call in self._open]

    def acknowledge(self, stage: str, aborted: common_pb2.Aborted) -> CancelOutcome:
        """The request stopped in `stage` (the stage's own ack, or before it started)."""
        if self.outcome is None:
            self.outcome = CancelOutcome(
                request_id=self.request_id, state=common_pb2.REQUEST_STATE_ABORTED, stage=stage,
                step_index=aborted.step_index,
                abort_latency_seconds=aborted.abort_latency_seconds)
            self._settled.set()
        return self.outcome

    def settle(self, state: RequestState) -> None:
        """The request ended without a stage ack (completed, failed): tell a waiting canceller."""
        if self.outcome is None:
            self.outcome = CancelOutcome(request_id=self.request_id, state=state)
            self._settled.set()

    async def cancel(self, reason: str) -> CancelOutcome:
        """Cancel by id: stop the current stage call (or the next one) and await the outcome.

        Every open stage call (a speech request has two at once, an image request one per
        image in flight) gets a Cancel message; the first ack, with the step reached and the
        abort latency, is the answer. Between stages, the next stage call is stopped as soon as
        it opens. A request that completes first reports SUCCEEDED.
        """
        if self.outcome is None:
            self._cancel_requested = True
            # return_exceptions: a stream that just ended refuses the write; the others still
            # get theirs.
            await asyncio.gather(*(call.send_cancel(reason) for call in list(self._open)),
                                 return_exceptions=True)
            try:
                await asyncio.wait_for(self._settled.wait(), CANCEL_ACK_TIMEOUT_S)
            except TimeoutError:
                self.acknowledge(self._open[0].stage if self._open else "", common_pb2.Aborted())
        assert self.outcome is not None
        return self.outcome


def max_request_id_chars(parts: int) -> int:
    """The longest request id whose sub-ids (see `sub_request_id`) the stages still accept."""
    return MAX_REQUEST_ID_CHARS - (len(sub_request_id("", parts - 1, parts)) if parts > 1 else 0)


class ScopeRegistry:
    """The live scopes by owner and request id, for cancel-by-id: an id is taken only for the
    owner whose request holds it (another owner may run a request of the same id).

    A request of several parts also holds its parts' sub-ids, so that no other request can
    take an id the stages already know (e.g. a client's "a.1" while request "a" has n=2, with
    API keys off; an owner's ids are qualified, see `stage_request_id`, and never meet).
    """

    def __init__(self) -> None:
        self._scopes: dict[tuple[str, str], CancelScope] = {}  # by (owner, client id)
        self._taken: set[str] = set()  # the ids the live requests give the stages

    def open(self, request_id: str | None, timeout: float | None, parts: int = 1,
             owner: str = "") -> CancelScope:
        """A scope for a request of `parts` stage requests (the images of an image request),
        started by `owner` (see CancelScope.owner).

        Raises ValueError for an id too long for the stages (once suffixed, with parts > 1),
        KeyError for an id (or one of its sub-ids) a live request of the same owner uses.
        """
        request_id = request_id or new_request_id()
        limit = max_request_id_chars(parts)
        if len(request_id) > limit:
            suffixed = f" (a request of {parts} images gives each a suffix)" if parts > 1 else ""
            raise ValueError(f"request id longer than {limit} characters{suffixed}")
        stage_id = stage_request_id(request_id, owner)
        ids = {stage_id, *sub_request_ids(stage_id, parts)}
        if (owner, request_id) in self._scopes or not ids.isdisjoint(self._taken):
            raise KeyError(request_id)
        scope = CancelScope(request_id, timeout, parts, owner)
        self._scopes[owner, request_id] = scope
        self._taken |= ids
        return scope

    def close(self, scope: CancelScope) -> None:
        key = (scope.owner, scope.request_id)
        if self._scopes.get(key) is scope:
            del self._scopes[key]
            self._taken -= {scope.stage_request_id, *scope.sub_request_ids}

    def get(self, request_id: str, owner: str = "") -> CancelScope | None:
        """The live scope of `owner`'s request `request_id` (a request of another owner is
        not found: its id says nothing to this caller)."""
        return self._scopes.get((owner, request_id))


# -- a stage call ---------------------------------------------------------------------------------

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
