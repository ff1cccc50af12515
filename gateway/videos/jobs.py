"""Video jobs: a video made in the background while the client polls, watches or deletes it.

A job is created queued (its record in the VideoStore), waits for one of this gateway's
`max_running` job slots, then runs the video pipeline under a CancelScope whose request id is
the job's id, writing its MP4 as the VAE decodes it and its progress after each step. Every
transport (OpenAI REST, gRPC, native REST) calls this one class, found by `video_jobs(core)`.

Stopping a job, from any gateway sharing the store:
- DELETE here, or cancel by id here: the job's scope is cancelled (the open stage stops at its
  next step, no later stage starts), or a queued job's task is cancelled before it starts;
- DELETE or cancel by id on another gateway: a marker file in the store (the runner stops at its
  next write, and a queued job never starts) and a cancel fanned out to every stage replica
  (GatewayCore.cancel), which stops the work at once.
A job's owner is the API key that created it; other owners get 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from typing import ParamSpec, TypeVar
from weakref import WeakKeyDictionary

import grpc

from stagemesh.gateway.core import GatewayCore, JobCancel
from stagemesh.gateway.errors import GatewayError, InvalidRequest
from stagemesh.gateway.mesh.calls import CANCEL_ACK_TIMEOUT_S, CancelOutcome
from stagemesh.gateway.videos.mux import Mp4Writer
from stagemesh.gateway.videos.pipeline import Mp4Sink, VideoSpec, make_video
from stagemesh.gateway.videos.store import (
    HEARTBEAT_S,
    JobLimit,
    JobRecord,
    JobStatus,
    JobStopped,
    StoreLimits,
    VideoStore,
    default_root,
)
from stagemesh.shared.limits import MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN
from stagemesh.shared.proto.v1 import common_pb2

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: Jobs this gateway runs at once; the rest wait, queued (the stages batch what runs).
MAX_RUNNING_JOBS = 2
#: A job's time budget once it starts running.
JOB_TIMEOUT_S = 3600.0
#: Progress is saved to the store at most this often (state changes always).
SAVE_INTERVAL_S = 0.5
#: How often a watch of a job another gateway runs re-reads its record.
WATCH_POLL_S = 1.0
#: Retry-After of a create refused by the store's live-job limit.
JOB_LIMIT_RETRY_S = 30
#: Download chunks.
CHUNK_BYTES = 1024 * 1024
#: Jobs per page of a listing: when not given, and at most.
DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100


def new_video_id() -> str:
    """A job id when the client chose none (OpenAI's look: `video_<hex>`)."""
    return f"video_{uuid.uuid4().hex}"


def valid_id(job_id: str) -> bool:
    """Could a job have this id? (request_ids.py's rule: the id names the job's files.)"""
    return len(job_id) <= MAX_REQUEST_ID_CHARS and bool(REQUEST_ID_PATTERN.fullmatch(job_id))


def not_found(job_id: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.NOT_FOUND, f"no video job with id {job_id[:200]!r}",
                        "id")


@dataclass(eq=False)
class _LocalJob:
    """A job this gateway runs: its latest record, its task, and who waits for changes."""

    spec: VideoSpec
    record: JobRecord
    task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    saved_at: float = 0.0
    stop_reason: str = ""  # set when this gateway stops it (DELETE, cancel by id)
    deleted: bool = False
    #: The latest step preview (PNG), when the job asked for them; never stored.
    preview: common_pb2.Preview | None = None

    def update(self, record: JobRecord) -> None:
        """The new record; every watcher wakes."""
        self.record = record
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass(frozen=True)
class JobView:
    """What a watch sees: the job's record and, while this gateway runs it with previews, the
    latest step preview of its middle frame (previews are never stored: a watch on another
    gateway sees records only)."""

    record: JobRecord
    preview: common_pb2.Preview | None = None

    def key(self) -> tuple[JobStatus, float, int]:
        """What a watcher is told again when it changes."""
        return (self.record.status, self.record.progress,
                self.preview.step_index if self.preview is not None else 0)


class VideoJobs:
    """Create, read, list, watch, download and delete video jobs (see the module docstring)."""

    def __init__(self, core: GatewayCore, store: VideoStore,
                 max_running: int = MAX_RUNNING_JOBS) -> None:
        self.core = core
        self.store = store
        self._slots = asyncio.Semaphore(max_running)
        self._local: dict[tuple[str, str], _LocalJob] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        self._closing = False

    # -- create --------------------------------------------------------------------------------

    async def create(self, spec: VideoSpec, job_id: str, owner: str) -> JobRecord:
        """Store the job queued and start it; 409 for an id the owner already has, 429 when
        the store holds its limit of live jobs."""
        if self._closing:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the gateway is stopping")
        params = spec.params
        record = JobRecord(
            id=job_id, owner=owner, model=spec.recipe.name, prompt=params.prompt,
            width=params.width, height=params.height, num_frames=params.num_frames,
            fps=params.fps, seed=params.seed, status=JobStatus.QUEUED, created_at=time.time(),
            runner=self.store.runner, image_to_video=params.image is not None,
            params={"num_inference_steps": params.num_inference_steps,
                    "guidance_scale": params.guidance_scale,
                    "guidance_scale_2": params.guidance_scale_2,
                    "boundary_ratio": params.boundary_ratio, "flow_shift": params.flow_shift,
                    "step_cache_threshold": params.step_cache_threshold})
        if (owner, job_id) in self._local or self.core.scopes.get(job_id, owner) is not None:
            raise _taken(job_id)
        self._start_heartbeat()
        try:
            await self._io(self._create, record)
        except FileExistsError:
            raise _taken(job_id) from None
        except JobLimit as limit:
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(limit),
                               reason="VIDEO_JOB_LIMIT", retry_after=JOB_LIMIT_RETRY_S) from None
        local = _LocalJob(spec, record)
        self._local[owner, job_id] = local
        local.task = asyncio.create_task(self._run(local), name=f"video-job-{job_id}")
        return record

    async def _io(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A store call in a worker thread; a failing disk is a 503 naming the store (a
        missing or existing file is the caller's to handle)."""
        try:
            return await asyncio.to_thread(call, *args, **kwargs)
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as error:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"the video store at "
                               f"{self.store.root} cannot be used: {error}",
                               reason="VIDEO_STORE_UNAVAILABLE") from None

    def _create(self, record: JobRecord) -> None:
        self.store.beat()
        self.store.sweep()
        self.store.create(record)

    def _start_heartbeat(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.create_task(self._beat(), name="video-store-heartbeat")

    async def _beat(self) -> None:
        """Tell other gateways sharing the store that this one still runs its jobs."""
        while True:
            try:
                await asyncio.to_thread(self.store.beat)
            except OSError as error:
                log.warning("video store heartbeat failed: %s", error)
            await asyncio.sleep(HEARTBEAT_S)

    # -- run -----------------------------------------------------------------------------------

    async def _run(self, local: _LocalJob) -> None:
        """Queue for a slot, make the video, and save how the job ended."""
        record = local.record
        try:
            async with self._slots:
                await self._save(local, replace(local.record, status=JobStatus.IN_PROGRESS),
                                 force=True)
                record = await self._make(local)
        except JobStopped as stopped:
            local.deleted |= stopped.deleted
            record = _ended(local.record, JobStatus.CANCELLED, str(stopped), "cancelled")
        except GatewayError as error:
            if error.code is grpc.StatusCode.CANCELLED:
                record = _ended(local.record, JobStatus.CANCELLED,
                                local.stop_reason or error.message, "cancelled")
            else:
                record = _ended(local.record, JobStatus.FAILED, error.message,
                                error.reason.lower())
        except asyncio.CancelledError:
            record = self._stopped(local)
        except Exception as error:  # a bug: the job fails, the gateway goes on
            log.exception("video job %s failed", local.record.id)
            record = _ended(local.record, JobStatus.FAILED, f"internal error: {error}",
                            "internal")
        await self._finish(local, record)

    async def _make(self, local: _LocalJob) -> JobRecord:
        """The pipeline into `<id>.mp4.part`, moved into place when whole."""
        params, record = local.spec.params, local.record
        path = self.store.partial_path(record.owner, record.id)
        writer = await asyncio.to_thread(Mp4Writer, path, params.width, params.height,
                                         params.fps)
        try:
            context = self.core.job_context(record.id, record.owner, JOB_TIMEOUT_S)

            async def progress(stage: str, fraction: float) -> None:
                if fraction > local.record.progress:
                    await self._save(local, replace(local.record, progress=fraction))

            async def preview(picture: common_pb2.Preview) -> None:
                local.preview = picture
                local.update(local.record)

            await make_video(self.core, local.spec, context, Mp4Sink(writer), progress, preview)
            await asyncio.to_thread(writer.close)
        except BaseException:
            await asyncio.to_thread(writer.abort)
            raise
        finished = await self._io(self.store.finish_video, local.record)
        return _ended(finished, JobStatus.COMPLETED, "", "", progress=1.0)

    async def _save(self, local: _LocalJob, record: JobRecord, force: bool = False) -> None:
        """Keep `record` (watchers wake at once) and write it to the store at most every
        SAVE_INTERVAL_S; JobStopped when a gateway marked the job (checked every time)."""
        local.update(record)
        now = time.monotonic()
        if force or now - local.saved_at >= SAVE_INTERVAL_S:
            local.saved_at = now
            await self._io(self.store.save, record)
        else:  # a stop asked on another gateway still counts at every step
            await self._io(self.store.check_stop, record)

    async def _finish(self, local: _LocalJob, record: JobRecord) -> None:
        """Save the ended job (or remove it, when deleted) and forget it here."""
        key = (record.owner, record.id)
        try:
            if local.deleted:
                raise JobStopped(record.id, deleted=True)
            await self._io(self.store.save, record)
        except JobStopped as stopped:
            local.deleted |= stopped.deleted
        except (GatewayError, OSError) as error:
            log.error("video job %s: could not save how it ended: %s", record.id, error)
        with contextlib.suppress(GatewayError, OSError):
            await self._io(_remove_partial, self.store, record)
            if local.deleted:
                await self._io(self.store.remove, record.owner, record.id)
        local.update(record)
        if self._local.get(key) is local:
            del self._local[key]

    # -- read ----------------------------------------------------------------------------------

    async def get(self, owner: str, job_id: str) -> JobRecord:
        """The owner's job; 404 when there is none (an id no job could have included)."""
        if not valid_id(job_id):
            raise not_found(job_id)
        local = self._local.get((owner, job_id))
        if local is not None and not local.deleted:
            return local.record
        record = await self._io(self.store.get, owner, job_id)
        if record is None:
            raise not_found(job_id)
        return record

    async def owned(self, owner: str) -> list[JobRecord]:
        """The owner's jobs, newest first (this gateway's own with their latest progress)."""
        records = await self._io(self.store.owned, owner)
        return [self._fresh(record) for record in records]

    def _fresh(self, record: JobRecord) -> JobRecord:
        local = self._local.get((record.owner, record.id))
        return local.record if local is not None else record

    async def watch(self, owner: str, job_id: str) -> AsyncGenerator[JobView, None]:
        """The job now, then again each time its state, progress or preview changes, until it
        ends (a job another gateway runs is re-read every WATCH_POLL_S)."""
        last: JobView | None = None
        while True:
            local = self._local.get((owner, job_id))
            changed = local.changed if local is not None else None
            try:
                record = await self.get(owner, job_id)
            except GatewayError:
                if last is None:
                    raise
                return  # deleted while watched: the last record said so
            view = JobView(record, local.preview if local is not None else None)
            if last is None or view.key() != last.key():
                last = view
                yield view
            if not record.status.live:
                return
            if changed is None:
                await asyncio.sleep(WATCH_POLL_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), WATCH_POLL_S)

    async def content(self, owner: str, job_id: str) -> JobRecord:
        """A completed job (its MP4 is `store.video_path`); 400 while it is not completed."""
        record = await self.get(owner, job_id)
        if record.status is not JobStatus.COMPLETED:
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"video job {job_id} is {record.status.value}: its content is "
                               "available once it has completed", "id",
                               reason="VIDEO_NOT_READY")
        return record

    async def chunks(self, owner: str, job_id: str) -> AsyncGenerator[bytes, None]:
        """The MP4 of a completed job, CHUNK_BYTES at a time (read in a worker thread)."""
        record = await self.content(owner, job_id)
        try:
            file = await asyncio.to_thread(
                self.store.video_path(owner, record.id).open, "rb")
        except FileNotFoundError:
            raise not_found(job_id) from None
        try:
            while chunk := await asyncio.to_thread(file.read, CHUNK_BYTES):
                yield chunk
        finally:
            file.close()

    # -- stop ----------------------------------------------------------------------------------

    async def delete(self, owner: str, job_id: str) -> JobRecord:
        """Delete a job and its file: a running job stops at its next step, a queued one never
        starts. Returns the job as it ended."""
        local = self._local.get((owner, job_id))
        if local is not None and not local.deleted:
            local.deleted = True  # its runner removes the files as it ends
            return await self._stop_here(local, "deleted by the client")
        record = await self.get(owner, job_id)
        if not record.status.live:
            await self._io(self.store.remove, owner, job_id)
            return record
        await self._io(self.store.mark_deleted, owner, job_id)
        await self._fan_out(owner, job_id, "deleted by the client")
        return _ended(record, JobStatus.CANCELLED, "deleted by the client", "cancelled")

    async def cancel(self, owner: str, job_id: str, reason: str) -> JobCancel | None:
        """Cancel by id of a job without a live scope here (GatewayCore.cancel tries the scope
        first): a job queued here is stopped; one live on another gateway is marked (its
        runner stops at its next write) and the caller fans the cancel out. None when no live
        job has that id."""
        aborted = CancelOutcome(request_id=job_id, state=common_pb2.REQUEST_STATE_ABORTED)
        local = self._local.get((owner, job_id))
        if local is not None:
            ended = await self._stop_here(local, reason)
            return JobCancel(aborted, stopped=True) if ended.status is JobStatus.CANCELLED \
                else None
        if not valid_id(job_id):
            return None
        record = await self._io(self.store.get, owner, job_id)
        if record is None or not record.status.live:
            return None
        await self._io(self.store.mark_cancelled, owner, job_id)
        return JobCancel(aborted, stopped=False)

    async def _stop_here(self, local: _LocalJob, reason: str) -> JobRecord:
        """Stop a job this gateway runs and wait (bounded) for it to end."""
        local.stop_reason = local.stop_reason or reason
        record = local.record
        scope = self.core.scopes.get(record.id, record.owner)
        if scope is not None:
            await scope.cancel(reason)
        elif local.task is not None:
            local.task.cancel()
        await self._ended_here([local], CANCEL_ACK_TIMEOUT_S)
        return local.record

    async def _ended_here(self, locals_: list[_LocalJob], timeout: float | None) -> None:
        """Wait (bounded) for jobs to end; a task cancelled before it began running never ran
        `_run`, so its end is saved here."""
        tasks = {local.task for local in locals_ if local.task is not None}
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for local in locals_:
            if local.task is not None and local.task.cancelled():
                local.task = None
                await self._finish(local, self._stopped(local))

    def _stopped(self, local: _LocalJob) -> JobRecord:
        """How a job stopped here ended: cancelled when asked, else the gateway stopped."""
        if local.stop_reason:
            return _ended(local.record, JobStatus.CANCELLED, local.stop_reason, "cancelled")
        return _ended(local.record, JobStatus.FAILED, "the gateway stopped before the job "
                      "finished", "gateway_stopped")

    async def _fan_out(self, owner: str, job_id: str, reason: str) -> None:
        """Stop the job's work on whichever stage replica holds it (another gateway runs it);
        a job between stages, or queued there, is stopped by its marker instead."""
        with contextlib.suppress(GatewayError):
            await self.core.cancel_remote(job_id, reason, owner)

    async def close(self) -> None:
        """Gateway shutdown: every job still here ends as failed ("the gateway stopped")."""
        self._closing = True
        jobs = list(self._local.values())
        for local in jobs:
            if local.task is not None:
                local.task.cancel()
        await self._ended_here(jobs, None)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.store.stop_beating)


def page(records: list[JobRecord], limit: int | None, after: str, limit_field: str,
         after_field: str) -> tuple[list[JobRecord], bool]:
    """One page of a listing: up to `limit` records after the one whose id is `after` (none:
    from the first), and whether more follow. A bad limit or an unknown `after` is a 400
    naming its field."""
    size = DEFAULT_PAGE_SIZE if limit is None else limit
    if not 1 <= size <= MAX_PAGE_SIZE:
        raise InvalidRequest(limit_field, f"{limit_field} must be between 1 and "
                             f"{MAX_PAGE_SIZE}, got {size}")
    start = 0
    if after:
        ids = [record.id for record in records]
        if after not in ids:
            raise InvalidRequest(after_field, f"{after_field} {after!r} names no video job of "
                                 "this listing")
        start = ids.index(after) + 1
    return records[start:start + size], start + size < len(records)


def _ended(record: JobRecord, status: JobStatus, error: str, code: str,
           progress: float | None = None) -> JobRecord:
    return replace(record, status=status, error=error, error_code=code,
                   completed_at=time.time(),
                   progress=record.progress if progress is None else progress)


def _taken(job_id: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.ALREADY_EXISTS,
                        f"a video job with id {job_id!r} exists already", "id")


def _remove_partial(store: VideoStore, record: JobRecord) -> None:
    with contextlib.suppress(FileNotFoundError):
        store.partial_path(record.owner, record.id).unlink()


#: The video jobs of each open core (one per core: cancel by id reaches them through it).
_JOBS: WeakKeyDictionary[GatewayCore, VideoJobs] = WeakKeyDictionary()


def video_jobs(core: GatewayCore) -> VideoJobs:
    """The core's video jobs, in STAGEMESH_VIDEO_STORE (nothing is read or written before a
    job), registered with the core on first use (the gateway's lifespan opens them)."""
    jobs = _JOBS.get(core)
    if jobs is None:
        jobs = VideoJobs(core, VideoStore(default_root(os.environ),
                                          StoreLimits.from_env(os.environ)))
        _JOBS[core] = jobs
        core.add_jobs(jobs)
    return jobs
