"""Per-request cancellation scope: one deadline, one owner of every downstream call.

Triggers and what they do:
- client disconnect / gRPC cancel: the task running the request is cancelled; the open stage call
  is cancelled with it (the stage sees a cancelled RPC and aborts the request at once);
- explicit cancel by id (`cancel`): a Cancel message goes down the open stage stream, and the
  caller gets the stage's acknowledgement (step reached, abort latency);
- deadline: every stage call gets `timeout = remaining budget`, so the stage drops the request
  itself when it passes (grpc-python does not propagate deadlines).
Once cancelled, no later stage is started for the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeAlias

from stagemesh.shared.limits import MAX_REQUEST_ID_CHARS
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


def new_request_id() -> str:
    """An id for a request whose client chose none."""
    return f"req-{uuid.uuid4().hex}"


class CancelScope:
    """Deadline and cancellation of one gateway request (see the module docstring)."""

    def __init__(self, request_id: str, timeout: float | None) -> None:
        self.request_id = request_id
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.outcome: CancelOutcome | None = None
        self._open: dict[str, SendCancel] = {}  # stage -> how to cancel its open call
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

    def enter_stage(self, stage: str, send_cancel: SendCancel) -> None:
        """Called once a stage call has started. Raises if a cancel came first: the caller then
        cancels the call it just opened, and no later stage runs."""
        self.check(stage)
        self._open[stage] = send_cancel

    def leave_stage(self, stage: str) -> None:
        self._open.pop(stage, None)

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

        Every open stage call (a speech request has two at once) gets a Cancel message; the
        first ack, with the step reached and the abort latency, is the answer. Between stages,
        the next stage call is stopped as soon as it opens. A request that completes first
        reports SUCCEEDED.
        """
        if self.outcome is None:
            self._cancel_requested = True
            for send_cancel in list(self._open.values()):
                with contextlib.suppress(Exception):  # a stream that just ended
                    await send_cancel(reason)
            try:
                await asyncio.wait_for(self._settled.wait(), CANCEL_ACK_TIMEOUT_S)
            except TimeoutError:
                self.acknowledge(next(iter(self._open), ""), common_pb2.Aborted())
        assert self.outcome is not None
        return self.outcome


class ScopeRegistry:
    """The live scopes by request id, for cancel-by-id."""

    def __init__(self) -> None:
        self._scopes: dict[str, CancelScope] = {}

    def open(self, request_id: str | None, timeout: float | None) -> CancelScope:
        request_id = request_id or new_request_id()
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request id longer than {MAX_REQUEST_ID_CHARS} characters")
        if request_id in self._scopes:
            raise KeyError(request_id)
        scope = CancelScope(request_id, timeout)
        self._scopes[request_id] = scope
        return scope

    def close(self, scope: CancelScope) -> None:
        if self._scopes.get(scope.request_id) is scope:
            del self._scopes[scope.request_id]

    def get(self, request_id: str) -> CancelScope | None:
        return self._scopes.get(request_id)
