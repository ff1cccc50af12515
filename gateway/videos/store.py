"""Video jobs on disk: one JSON record and one MP4 per job, in a directory gateway replicas may
share (`STAGEMESH_VIDEO_STORE`; in Kubernetes a volume mounted by every replica).

Layout: `<root>/<owner>/<job id>.json` (the record), `.mp4` (the video, once it succeeded)
and `.deleted` (a DELETE's marker, see below); `<root>/gateways/<instance>` is the heartbeat
of each gateway that runs jobs (touched every HEARTBEAT_S). `<owner>` is the API key's owner
id (`anonymous` with keys off), so one owner's jobs are never another's: they are not found.

Rules, each owned here:
- Limits: at most `max_jobs` records, `max_bytes` of MP4 and `max_age_s` of age after a job
  ended. Finished jobs are evicted oldest first to make room; a create while `max_jobs` jobs
  are still queued or running is refused with 429 (RESOURCE_EXHAUSTED: it is a capacity limit
  that frees up as jobs end, so a retry later succeeds).
- Restart: a job whose record says queued or running, but whose gateway is gone (its
  heartbeat stale or missing, or on this host its process gone), reads back as `failed` with
  an error saying the gateway stopped; the record is rewritten so.
- Delete of a job still running elsewhere: the deleting gateway writes the `.deleted` marker
  (its runner stops at its next write, and removes the files); the job is not found from then on.

Every method does file I/O: call it off the event loop (VideoJobs does, via asyncio.to_thread).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

log = logging.getLogger(__name__)

STORE_ENV = "STAGEMESH_VIDEO_STORE"
MAX_JOBS_ENV = "STAGEMESH_VIDEO_STORE_MAX_JOBS"
MAX_BYTES_ENV = "STAGEMESH_VIDEO_STORE_MAX_BYTES"
MAX_AGE_ENV = "STAGEMESH_VIDEO_STORE_MAX_AGE_S"
DEFAULT_MAX_JOBS = 1000
DEFAULT_MAX_BYTES = 10 * 1024**3
DEFAULT_MAX_AGE_S = 24 * 3600.0
#: How often a gateway running jobs touches its heartbeat, and how old one may be before its
#: jobs are taken for lost.
HEARTBEAT_S = 5.0
STALE_AFTER_S = 30.0
ANONYMOUS_DIR = "anonymous"
GATEWAYS_DIR = "gateways"
#: The error a job lost in a gateway restart reads back with.
LOST_ERROR = "the gateway running this job stopped (restart or crash) before it finished"


class JobStatus(enum.StrEnum):
    """A job's state, with OpenAI's video names (plus `cancelled`)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def live(self) -> bool:
        return self in (JobStatus.QUEUED, JobStatus.IN_PROGRESS)


class JobLimit(Exception):
    """A create past the limit of live jobs."""


class JobStopped(Exception):
    """A gateway asked the job's runner to stop (its `.deleted` or `.cancel` marker exists):
    the runner stops at its next write."""

    def __init__(self, job_id: str, deleted: bool) -> None:
        super().__init__(f"video job {job_id} was {'deleted' if deleted else 'cancelled'}")
        self.deleted = deleted


#: When this process started (as its module was first imported): a process that reuses a pid
#: (a restarted container's gateway is often pid 1 again) has another.
PROCESS_STARTED = time.time()


@dataclass(frozen=True)
class Runner:
    """The gateway that runs a job: its host, process (pid and start) and instance (one process
    may hold several gateways, e.g. in tests)."""

    host: str
    pid: int
    instance: str
    process_started: float = 0.0

    @classmethod
    def here(cls) -> Runner:
        return cls(host=socket.gethostname(), pid=os.getpid(), instance=uuid.uuid4().hex,
                   process_started=PROCESS_STARTED)


@dataclass(frozen=True)
class JobRecord:
    """One video job, as stored (and as GetVideo / GET /v1/videos/{id} show it)."""

    id: str
    owner: str
    model: str
    prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    status: JobStatus
    created_at: float
    runner: Runner
    progress: float = 0.0  # 0 to 1
    completed_at: float | None = None
    error: str = ""
    error_code: str = ""
    size_bytes: int = 0
    image_to_video: bool = False
    #: Extra facts for the client (steps, guidance), as given to the stages.
    params: dict[str, float | int | None] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps if self.fps else 0.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> JobRecord:
        """A record read back; ValueError (or KeyError/TypeError) when it is malformed."""
        fields = _Fields(data)
        runner = _Fields(fields.mapping("runner"))
        completed = data.get("completed_at")
        params = fields.mapping("params")
        return cls(
            id=fields.text("id"), owner=fields.text("owner"), model=fields.text("model"),
            prompt=fields.text("prompt"), width=fields.integer("width"),
            height=fields.integer("height"), num_frames=fields.integer("num_frames"),
            fps=fields.integer("fps"), seed=fields.integer("seed"),
            status=JobStatus(fields.text("status")), created_at=fields.number("created_at"),
            runner=Runner(host=runner.text("host"), pid=runner.integer("pid"),
                          instance=runner.text("instance"),
                          process_started=runner.number("process_started")),
            progress=fields.number("progress"),
            completed_at=None if completed is None else fields.number("completed_at"),
            error=fields.text("error"), error_code=fields.text("error_code"),
            size_bytes=fields.integer("size_bytes"),
            image_to_video=bool(data.get("image_to_video", False)),
            params={str(k): v for k, v in params.items()
                    if v is None or (isinstance(v, int | float) and not isinstance(v, bool))})


class _Fields:
    """Typed reads of a JSON object's fields (a record written by another gateway version or
    edited by hand must not break a listing: the caller skips what raises)."""

    def __init__(self, data: Mapping[str, object]) -> None:
        self.data = data

    def text(self, name: str) -> str:
        value = self.data[name]
        if not isinstance(value, str):
            raise TypeError(f"{name} is not a string")
        return value

    def integer(self, name: str) -> int:
        value = self.data[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} is not an integer")
        return value

    def number(self, name: str) -> float:
        value = self.data[name]
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise TypeError(f"{name} is not a number")
        return float(value)

    def mapping(self, name: str) -> Mapping[str, object]:
        value = self.data.get(name, {})
        if not isinstance(value, dict):
            raise TypeError(f"{name} is not an object")
        return value


@dataclass(frozen=True)
class StoreLimits:
    max_jobs: int = DEFAULT_MAX_JOBS
    max_bytes: int = DEFAULT_MAX_BYTES
    max_age_s: float = DEFAULT_MAX_AGE_S

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StoreLimits:
        """The limits, each overridable by its environment variable."""
        try:
            return cls(max_jobs=int(env.get(MAX_JOBS_ENV, DEFAULT_MAX_JOBS)),
                       max_bytes=int(env.get(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)),
                       max_age_s=float(env.get(MAX_AGE_ENV, DEFAULT_MAX_AGE_S)))
        except ValueError as error:
            raise ValueError(f"bad video store limit in the environment: {error}") from None


def default_root(env: Mapping[str, str]) -> Path:
    """STAGEMESH_VIDEO_STORE, else `videos` under the user's cache ($XDG_CACHE_HOME or
    ~/.cache, then stagemesh/)."""
    if env.get(STORE_ENV):
        return Path(env[STORE_ENV])
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "stagemesh" / "videos"


def owner_dir(owner: str) -> str:
    return owner or ANONYMOUS_DIR


class VideoStore:
    """The job records and MP4s under `root` (see the module docstring)."""

    def __init__(self, root: Path, limits: StoreLimits | None = None,
                 runner: Runner | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.limits = limits or StoreLimits()
        self.runner = runner or Runner.here()
        self._clock = clock

    # -- paths ---------------------------------------------------------------------------------

    def _path(self, owner: str, job_id: str, suffix: str) -> Path:
        return self.root / owner_dir(owner) / f"{job_id}{suffix}"

    def video_path(self, owner: str, job_id: str) -> Path:
        return self._path(owner, job_id, ".mp4")

    def partial_path(self, owner: str, job_id: str) -> Path:
        """Where the MP4 is written while the job runs (renamed to video_path when done)."""
        return self._path(owner, job_id, ".mp4.part")

    def _heartbeat(self, runner: Runner) -> Path:
        return self.root / GATEWAYS_DIR / runner.instance

    # -- records -------------------------------------------------------------------------------

    def check_stop(self, record: JobRecord) -> None:
        """JobStopped when a DELETE or a cancel by id, from any gateway, marked the job."""
        if self._path(record.owner, record.id, ".deleted").exists():
            raise JobStopped(record.id, deleted=True)
        if record.status.live and self._path(record.owner, record.id, ".cancel").exists():
            raise JobStopped(record.id, deleted=False)

    def save(self, record: JobRecord) -> None:
        """Write `record` atomically; JobStopped if another gateway asked the job to stop
        (it is written when it ends, unless deleted: pass `final`)."""
        self.check_stop(record)
        path = self._path(record.owner, record.id, ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{self.runner.instance}.tmp")
        temporary.write_text(json.dumps(record.to_json()))
        os.replace(temporary, path)
        if not record.status.live:  # a cancel marker has done its work
            with contextlib.suppress(FileNotFoundError):
                self._path(record.owner, record.id, ".cancel").unlink()

    def create(self, record: JobRecord) -> None:
        """Store a new job's record, evicting finished jobs to keep within `max_jobs`; JobLimit
        when that many jobs are still live; FileExistsError when the owner has a job of that
        id already."""
        if self._path(record.owner, record.id, ".json").exists():
            raise FileExistsError(record.id)
        records = self.all_records()
        live = [r for r in records if r.status.live]
        if len(live) >= self.limits.max_jobs:
            raise JobLimit(f"{len(live)} video jobs are queued or running: the store's limit "
                           f"is {self.limits.max_jobs}")
        self._evict([r for r in records if not r.status.live],
                    len(records) + 1 - self.limits.max_jobs, self.limits.max_bytes)
        self.save(record)

    def get(self, owner: str, job_id: str) -> JobRecord | None:
        """The owner's job (a lost job reads as failed); None if there is none, or it was
        deleted."""
        if self._path(owner, job_id, ".deleted").exists():
            return None
        try:
            data = json.loads(self._path(owner, job_id, ".json").read_text())
            record = JobRecord.from_json(data)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as error:
            log.warning("unreadable video job record %s: %s", job_id, error)
            return None
        if record.owner != owner:
            return None
        return self._settle_lost(record)

    def owned(self, owner: str) -> list[JobRecord]:
        """The owner's jobs, newest first."""
        return sorted(self._records(self.root / owner_dir(owner), owner),
                      key=lambda r: (r.created_at, r.id), reverse=True)

    def all_records(self) -> list[JobRecord]:
        """Every owner's jobs (for the limits)."""
        if not self.root.is_dir():
            return []
        return [record for folder in sorted(self.root.iterdir())
                if folder.is_dir() and folder.name != GATEWAYS_DIR
                for record in self._records(folder, None)]

    def _records(self, folder: Path, owner: str | None) -> Iterator[JobRecord]:
        if not folder.is_dir():
            return
        for path in folder.glob("*.json"):
            job_id = path.name.removesuffix(".json")
            record = self.get(owner if owner is not None else _owner_of(folder), job_id)
            if record is not None:
                yield record

    def mark_deleted(self, owner: str, job_id: str) -> None:
        """The DELETE marker: the job is gone for readers; its runner stops at its next write
        and removes the files (or `sweep` does, for a job that no gateway runs)."""
        self._mark(owner, job_id, ".deleted")

    def mark_cancelled(self, owner: str, job_id: str) -> None:
        """The cancel-by-id marker: the job's runner stops at its next write (a queued job
        never starts) and saves it as cancelled."""
        self._mark(owner, job_id, ".cancel")

    def _mark(self, owner: str, job_id: str, suffix: str) -> None:
        path = self._path(owner, job_id, suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def remove(self, owner: str, job_id: str) -> None:
        """Remove a job's record, video and marker."""
        for suffix in (".mp4", ".mp4.part", ".json", ".cancel", ".deleted"):
            with contextlib.suppress(FileNotFoundError):
                self._path(owner, job_id, suffix).unlink()

    def finish_video(self, record: JobRecord) -> JobRecord:
        """Move the finished MP4 into place; the record with its size (not yet saved)."""
        partial = self.partial_path(record.owner, record.id)
        size = partial.stat().st_size
        os.replace(partial, self.video_path(record.owner, record.id))
        return replace(record, size_bytes=size)

    # -- limits --------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Remove finished jobs past `max_age_s`, and the oldest finished jobs while the MP4s
        take more than `max_bytes`; remove deleted jobs whose runner is gone."""
        now = self._clock()
        finished = [r for r in self.all_records() if not r.status.live]
        for record in finished:
            if now - (record.completed_at or record.created_at) > self.limits.max_age_s:
                self.remove(record.owner, record.id)
        self._evict([r for r in finished
                     if now - (r.completed_at or r.created_at) <= self.limits.max_age_s],
                    0, self.limits.max_bytes)
        self._sweep_deleted()

    def _evict(self, finished: list[JobRecord], count: int, max_bytes: int) -> None:
        """Remove the `count` oldest finished jobs, then more while the MP4s pass max_bytes."""
        finished.sort(key=lambda r: (r.completed_at or r.created_at, r.created_at))
        total = sum(r.size_bytes for r in finished)
        for index, record in enumerate(finished):
            if index >= count and total <= max_bytes:
                break
            self.remove(record.owner, record.id)
            total -= record.size_bytes

    def _sweep_deleted(self) -> None:
        if not self.root.is_dir():
            return
        for marker in self.root.glob("*/*.deleted"):
            owner, job_id = _owner_of(marker.parent), marker.name.removesuffix(".deleted")
            try:
                record = JobRecord.from_json(json.loads(
                    self._path(owner, job_id, ".json").read_text()))
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                self.remove(owner, job_id)
                continue
            if not record.status.live or not self.runner_alive(record.runner):
                self.remove(owner, job_id)

    # -- restart -------------------------------------------------------------------------------

    def beat(self) -> None:
        """This gateway is alive (it runs jobs): touch its heartbeat."""
        path = self._heartbeat(self.runner)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def stop_beating(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._heartbeat(self.runner).unlink()

    def runner_alive(self, runner: Runner) -> bool:
        """Is the gateway that ran a job still running it? This one is. On this host, not if
        its process is gone (its pid dead, or reused by a process started later); then, as
        for any other host, if its heartbeat is fresh."""
        if runner == self.runner:
            return True
        if runner.host == self.runner.host and (not _pid_alive(runner.pid) or (
                runner.pid == self.runner.pid
                and runner.process_started != self.runner.process_started)):
            return False
        try:
            age = self._clock() - self._heartbeat(runner).stat().st_mtime
        except FileNotFoundError:
            return False
        return age <= STALE_AFTER_S

    def _settle_lost(self, record: JobRecord) -> JobRecord:
        """A live record whose gateway is gone reads (and is saved) as failed."""
        if not record.status.live or self.runner_alive(record.runner):
            return record
        lost = replace(record, status=JobStatus.FAILED, error=LOST_ERROR,
                       error_code="gateway_restarted", completed_at=self._clock())
        with contextlib.suppress(JobStopped, OSError):
            self.save(lost)
        with contextlib.suppress(FileNotFoundError):
            self.partial_path(record.owner, record.id).unlink()
        return lost


def _owner_of(folder: Path) -> str:
    return "" if folder.name == ANONYMOUS_DIR else folder.name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
