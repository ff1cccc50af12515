"""StageControlService: the part of every stage that is not its model: cancel a request by id
from any gateway, and report load.

A gateway cancels the requests it runs itself through their own streams (a `cancel` message).
A cancel that lands on another gateway reaches the request here: that gateway fans the cancel
out to every replica of every stage, and the replica holding the request stops it and answers
with where it stopped. A replica that does not hold it keeps the cancel pending (the engine's
tombstones: at most MAX_TOMBSTONES per engine, for TOMBSTONE_TTL_SECONDS), so a request between
two stages is dropped when it reaches the next one. Only the owner that started a request (the
API key's id; "" when keys are off) may cancel it: for any other owner it does not exist. With
keys on, the stages know a request by its owner-qualified id (`<id>:<owner>`,
gateway/cancel.py `stage_request_id`), so two owners' requests of one client id stay apart,
and a gateway's cancel names that id.

The load report is what a gateway routes by: the requests a replica holds from every gateway,
and whether it drains. `stagemesh serve` also reads the pid from it, to check that the process
answering on a port is the one it started.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Iterable, Sequence
from typing import Protocol

import grpc

from stagemesh.shared.engine.events import Aborted, Completed, Failed
from stagemesh.shared.engine.request import AbortReason
from stagemesh.shared.errors import abort_with
from stagemesh.shared.limits import MAX_STAGE_REQUEST_ID_CHARS
from stagemesh.shared.proto.v1 import common_pb2, control_service_pb2_grpc
from stagemesh.shared.proto.v1 import control_service_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["StageControlService"].full_name
#: The metadata a gateway's stage call names its request's owner in (absent: owner "").
OWNER_METADATA_KEY = "x-stagemesh-owner"
#: How long a cancel waits for the stopped request's state to be freed (a request-mode
#: request runs to its end first).
CANCEL_WAIT_S = 10.0

Context = grpc.aio.ServicerContext[pb.CancelStageRequestRequest, pb.CancelStageRequestResponse]
LoadContext = grpc.aio.ServicerContext[pb.GetStageLoadRequest, pb.GetStageLoadResponse]
#: What a request's stream ends with, as the control service reads it.
Ending = Completed[object] | Aborted | Failed


class ControlledEngine(Protocol):
    """What the control service needs from a StepEngine."""

    @property
    def num_in_flight(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def closing(self) -> bool: ...

    def live_ids(self, request_id: str, owner: str) -> list[str]: ...

    def finished(self, request_id: str) -> Awaitable[Ending] | None: ...

    def abort(self, request_id: str, reason: AbortReason = ...,
              owner: str | None = ...) -> None: ...


def _answer(stage: str, endings: Sequence[Ending]) -> pb.CancelStageRequestResponse:
    """The reply for the live requests a cancel stopped (or that ended first): the first that
    stopped, else how the first one ended."""
    stopped = [ending for ending in endings if isinstance(ending, Aborted)]
    if stopped:
        return pb.CancelStageRequestResponse(
            outcome=pb.CANCEL_STAGE_OUTCOME_STOPPED, stage=stage,
            state=common_pb2.REQUEST_STATE_ABORTED, step_index=stopped[0].step_index,
            abort_latency_seconds=stopped[0].abort_latency_seconds)
    first = endings[0]
    return pb.CancelStageRequestResponse(
        outcome=pb.CANCEL_STAGE_OUTCOME_ENDED, stage=stage,
        state=(common_pb2.REQUEST_STATE_SUCCEEDED if isinstance(first, Completed)
               else common_pb2.REQUEST_STATE_FAILED),
        step_index=first.step_index if isinstance(first, Completed) else 0)


class StageControl(control_service_pb2_grpc.StageControlServiceServicer):
    """Cancel by id and load, over the engines of one stage process."""

    def __init__(self, stage: str, engines: Sequence[ControlledEngine]) -> None:
        self.stage = stage
        self.engines = list(engines)

    async def CancelStageRequest(
        self, request: pb.CancelStageRequestRequest, context: Context,
    ) -> pb.CancelStageRequestResponse:
        request_id = request.request_id
        if not request_id or len(request_id) > MAX_STAGE_REQUEST_ID_CHARS:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"request_id must be 1..{MAX_STAGE_REQUEST_ID_CHARS} characters",
                             reason="INVALID_ARGUMENT", field_name="request_id")
        waits: list[Awaitable[Ending]] = []
        for engine in self.engines:
            for rid in engine.live_ids(request_id, request.owner):
                ending = engine.finished(rid)  # registered before the abort can land
                if ending is not None:
                    waits.append(ending)
                    engine.abort(rid, AbortReason.CANCELLED, request.owner)
        if not waits:
            for engine in self.engines:  # pending: dropped on arrival, for this owner only
                engine.abort(request_id, AbortReason.CANCELLED, request.owner)
            return pb.CancelStageRequestResponse(outcome=pb.CANCEL_STAGE_OUTCOME_PENDING,
                                                 stage=self.stage)
        log.info("cancel by id for %s: %s", request_id, request.reason or "no reason given")
        try:
            endings = await asyncio.wait_for(asyncio.gather(*waits), CANCEL_WAIT_S)
        except TimeoutError:
            await abort_with(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"request {request_id} did not stop within {CANCEL_WAIT_S:g} s",
                             reason="CANCEL_TIMEOUT")
        return _answer(self.stage, endings)

    async def GetStageLoad(
        self, request: pb.GetStageLoadRequest, context: LoadContext,
    ) -> pb.GetStageLoadResponse:
        return pb.GetStageLoadResponse(
            stage=self.stage, in_flight=sum(e.num_in_flight for e in self.engines),
            waiting=sum(e.num_waiting for e in self.engines),
            running=sum(e.num_running for e in self.engines),
            draining=any(e.closing for e in self.engines), pid=os.getpid())


def owner_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The owner a stage call carries (see OWNER_METADATA_KEY)."""
    for key, value in metadata or ():
        if key == OWNER_METADATA_KEY:
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return ""


def add_control(server: grpc.aio.Server, control: StageControl) -> None:
    control_service_pb2_grpc.add_StageControlServiceServicer_to_server(control, server)
