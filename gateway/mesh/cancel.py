"""Per-request cancellation scope: one deadline, one owner of every downstream call.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeAlias

from stagemesh.shared.limits import MAX_REQUEST_ID_CHARS, OWNER_ID_CHARS
from stagemesh.shared.proto.v1 import common_pb2

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
