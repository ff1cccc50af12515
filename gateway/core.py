"""What every resource shares: the request scope, cancel by id, and the stages' infos.

Each resource (images/, speech/, chat/, videos/) prepares a request (recipe chosen, stage facts
read, every field checked: a bad field is refused before any stage runs and before a streamed
response starts) and runs it inside `GatewayCore.request_scope`, the CancelScope that turns
every failure into a GatewayError. Every transport (OpenAI REST, native REST, gRPC) calls them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

from stagemesh.gateway.errors import GatewayError, InvalidRequest, StageUnavailable
from stagemesh.gateway.mesh.calls import (
    CancelOutcome,
    CancelScope,
    DeadlineExceeded,
    RequestCancelled,
    ScopeRegistry,
    StageCallError,
    new_request_id,
    stage_request_id,
)
from stagemesh.gateway.mesh.runtime_loras import RuntimeLoras
from stagemesh.gateway.mesh.stages import (
    LORA_FIELD,
    Mesh,
    StageCancel,
    StageCatalog,
    publish_into,
)
from stagemesh.gateway.recipes import Recipe
from stagemesh.shared.logs import request_id_var
from stagemesh.shared.proto.v1 import common_pb2, control_service_pb2, gateway_service_pb2

CANCEL_PENDING = control_service_pb2.CANCEL_STAGE_OUTCOME_PENDING
CANCEL_STOPPED = control_service_pb2.CANCEL_STAGE_OUTCOME_STOPPED

#: Picked seeds stay below 2**31, so they read the same in every client language.
RANDOM_SEEDS = 2**31
#: Every request gets a deadline: this one when the client gives none.
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 3600.0


def random_seed() -> int:
    """The seed a request gets when its client gives none."""
    return random.randrange(RANDOM_SEEDS)


@dataclass(frozen=True)
class RequestContext:
    """What the transport knows about a request: its id and its time budget."""

    request_id: str
    timeout: float | None = None  # seconds; None = DEFAULT_TIMEOUT_S
    #: Who started the request: the owner id of the caller's API key ("" with auth off).
    owner: str = ""

    @classmethod
    def create(cls, request_id: str | None, timeout: float | None,
               owner: str = "") -> RequestContext:
        """Check the client's timeout; an empty id gets a new one."""
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
            raise InvalidRequest("timeout", f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds")
        return cls(request_id or new_request_id(), timeout, owner)

    def for_request(self, request_id: str) -> RequestContext:
        """The id a request message carries wins over the transport's."""
        return replace(self, request_id=request_id) if request_id else self


@dataclass(frozen=True)
class JobCancel:
    """A cancel by id that found a live background job: `stopped` here, or only marked in a
    shared store (the gateway running it stops it; the caller also fans the cancel out to the
    stages)."""

    outcome: CancelOutcome
    stopped: bool


class BackgroundJobs(Protocol):
    """Work that outlives the request that started it (video jobs): a cancel by id reaches
    it, and it stops when the core closes. A resource registers its jobs with `add_jobs`."""

    async def cancel(self, owner: str, job_id: str, reason: str) -> JobCancel | None: ...

    async def close(self) -> None: ...


class GatewayCore:
    """Prepare, run and cancel requests on a started Mesh and StageCatalog."""

    def __init__(self, mesh: Mesh, catalog: StageCatalog) -> None:
        self.mesh = mesh
        self.catalog = catalog
        #: The LoRA adapters loaded at run time, put back on a DiT replica that serves again.
        self.loras = RuntimeLoras(catalog)
        mesh.on_back(self.loras.restore)
        self.scopes = ScopeRegistry()
        self.jobs: list[BackgroundJobs] = []

    @property
    def recipes(self) -> dict[str, Recipe]:
        return self.mesh.recipes

    def add_jobs(self, jobs: BackgroundJobs) -> None:
        self.jobs.append(jobs)

    async def close(self) -> None:
        """Stop the background jobs (those still running end as failed)."""
        for jobs in self.jobs:
            await jobs.close()

    def job_context(self, job_id: str, owner: str, timeout: float) -> RequestContext:
        """A background job's context: its id is the job's, its owner the creator's."""
        return RequestContext(job_id, timeout, owner)

    # -- control -------------------------------------------------------------------------------

    async def stage_infos(self) -> list[gateway_service_pb2.StageInfo]:
        """Every stage's health, plus what it published: device, dtype, quantization,
        compilation, a DiT's parallel group (`stages.publish_into`; empty if unreadable)."""
        rows = await self.mesh.stage_rows()
        answers = await asyncio.gather(*(self.catalog.answer(endpoint) for endpoint, _ in rows))
        for (_, info), answer in zip(rows, answers, strict=True):
            if answer is not None:
                publish_into(info, answer)
        return [info for _, info in rows]

    async def cancel(self, request_id: str, reason: str = "cancelled by id",
                     owner: str = "") -> CancelOutcome:
        """Cancel a request by id, wherever it runs, if `owner` (the caller's API key owner;
        "" with keys off) started it; otherwise it is not found.

        A request this gateway runs is stopped through its own stage streams. Any other (run
        by another gateway replica) is stopped by a cancel sent to every replica of every
        stage (shared/control.py): the replica holding it stops it and answers. A replica not
        holding it keeps the cancel pending for a minute, so a request between two stages
        stops when it reaches the next one; the answer is then NOT_FOUND, as for an id no
        stage knows. A video job's id is its request id: one queued here never starts, and one
        another gateway runs is also marked in the shared store (videos/jobs.py), so it stops
        even while it waits between stages.
        """
        scope = self.scopes.get(request_id, owner)
        if scope is not None:
            return await scope.cancel(reason)
        # a job queued here, or live on another gateway sharing its store (videos/jobs.py)
        job = await self._cancel_job(owner, request_id, reason)
        if job is not None and job.stopped:
            return job.outcome
        try:
            return await self.cancel_remote(request_id, reason, owner)
        except GatewayError:
            if job is None:
                raise
            return job.outcome  # marked: its gateway stops it before its next stage or step

    async def _cancel_job(self, owner: str, job_id: str, reason: str) -> JobCancel | None:
        for jobs in self.jobs:
            found = await jobs.cancel(owner, job_id, reason)
            if found is not None:
                return found
        return None

    async def cancel_remote(self, request_id: str, reason: str, owner: str) -> CancelOutcome:
        """Cancel a request another gateway runs: sent to every replica of every stage;
        NOT_FOUND when no replica holds it (see `cancel`)."""
        # the stages know the request by its owner-qualified id (cancel.stage_request_id)
        replies = await self.mesh.cancel_everywhere(stage_request_id(request_id, owner), reason,
                                                    owner)
        outcome = remote_outcome(request_id, self.mesh, replies)
        if outcome is None:
            raise GatewayError(grpc.StatusCode.NOT_FOUND,
                               f"no running request with id {request_id!r}", "request_id")
        return outcome

    @contextlib.asynccontextmanager
    async def request_scope(self, recipe: Recipe, context: RequestContext,
                            parts: int = 1) -> AsyncIterator[CancelScope]:
        """Open a CancelScope (for a request of `parts` stage requests, e.g. n images) and turn
        every failure inside into a GatewayError."""
        try:
            scope = self.scopes.open(context.request_id, context.timeout or DEFAULT_TIMEOUT_S,
                                     parts, context.owner)
        except KeyError:
            raise GatewayError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request id {context.request_id!r} is already in use",
                               "request_id") from None
        except ValueError as error:
            raise InvalidRequest("request_id", str(error)) from None
        token = request_id_var.set(scope.request_id)
        state = common_pb2.REQUEST_STATE_FAILED
        try:
            yield scope
            state = common_pb2.REQUEST_STATE_SUCCEEDED
        except RequestCancelled as cancelled:
            raise GatewayError(grpc.StatusCode.CANCELLED,
                               f"request {scope.request_id} was cancelled "
                               f"(stage {cancelled.outcome.stage or 'none'})") from None
        except DeadlineExceeded as error:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, str(error)) from None
        except StageCallError as failed:
            self._forget_stale_facts(recipe, failed)
            raise stage_error(recipe, failed) from None
        finally:
            scope.settle(state)
            self.scopes.close(scope)
            request_id_var.reset(token)

    def _forget_stale_facts(self, recipe: Recipe, failed: StageCallError) -> None:
        """A stage refused an adapter its published facts offered (unloaded since, or on one
        of its replicas only): the next request reads its Describe again."""
        endpoint = recipe.stages.get(failed.stage)
        if failed.error.field_name == LORA_FIELD and endpoint is not None:
            self.catalog.drop(endpoint.address)


def remote_outcome(request_id: str, mesh: Mesh, replies: list[StageCancel]
                   ) -> CancelOutcome | None:
    """What a cancel fanned out to the replicas did: the replica that stopped the request
    (the earliest stage of the recipes, if several did), else one where it had just ended;
    None if no replica held it."""
    order = {e.name: i for i, (_, e) in enumerate(mesh.endpoints())}
    held = sorted((r for r in replies if r.reply.outcome != CANCEL_PENDING),
                  key=lambda r: (r.reply.outcome != CANCEL_STOPPED, order.get(r.stage, 0)))
    if not held:
        return None
    reply = held[0].reply
    return CancelOutcome(request_id=request_id, state=reply.state, stage=held[0].stage,
                         step_index=reply.step_index,
                         abort_latency_seconds=reply.abort_latency_seconds)


def stage_error(recipe: Recipe, failed: StageCallError) -> GatewayError:
    """A failed stage call, as the client sees it (a stage that is down is named, and the
    replica when the stage has several)."""
    error = failed.error
    endpoint = recipe.stages.get(failed.stage)
    address = failed.replica or (endpoint.address if endpoint else "")
    where = f"{failed.stage} stage at {address}" if address else failed.stage
    if error.code is grpc.StatusCode.UNAVAILABLE:
        return StageUnavailable(f"{where} is unavailable: {error.message}", error.reason)
    if error.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(error.code, f"deadline exceeded in the {where}",
                            reason=error.reason)
    return GatewayError.from_stage(error)
