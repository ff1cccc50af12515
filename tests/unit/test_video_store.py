"""The video job store: one JSON record and MP4 per job, owners kept apart, limits on count,
bytes and age (oldest finished first; a create past the live-job limit is refused), a job lost
in a gateway restart reading back as failed, and the stop markers other gateways leave."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from stagemesh.gateway.videos.store import (
    LOST_ERROR,
    PROCESS_STARTED,
    JobLimit,
    JobRecord,
    JobStatus,
    JobStopped,
    Runner,
    StoreLimits,
    VideoStore,
    default_root,
)

NOW = 1_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def record(job_id: str, *, owner: str = "", status: JobStatus = JobStatus.COMPLETED,
           created: float = NOW, size: int = 0, runner: Runner | None = None) -> JobRecord:
    return JobRecord(id=job_id, owner=owner, model="wan", prompt="p", width=32, height=32,
                     num_frames=9, fps=8, seed=1, status=status, created_at=created,
                     runner=runner or Runner("elsewhere", 1, "gone"),
                     completed_at=None if status.live else created, size_bytes=size)


def store_at(root: Path, clock: Clock | None = None, *, max_jobs: int = 100,
             max_bytes: int = 10**9, max_age_s: float = 3600.0) -> VideoStore:
    return VideoStore(root, StoreLimits(max_jobs, max_bytes, max_age_s),
                      runner=Runner("this-host", os.getpid(), "me", PROCESS_STARTED),
                      clock=clock or Clock())


def test_a_record_reads_back_as_written_and_only_for_its_owner(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    mine = record("video_1", owner="key-a", runner=store.runner, status=JobStatus.IN_PROGRESS)
    store.create(mine)
    assert store.get("key-a", "video_1") == mine
    assert store.get("key-b", "video_1") is None and store.get("", "video_1") is None
    assert [r.id for r in store.owned("key-a")] == ["video_1"] and store.owned("key-b") == []
    with pytest.raises(FileExistsError):
        store.create(mine)


def test_listing_is_newest_first(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    for index in range(3):
        store.create(record(f"v{index}", created=NOW + index))
    assert [r.id for r in store.owned("")] == ["v2", "v1", "v0"]


def test_the_oldest_finished_jobs_make_room_past_the_count_limit(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_jobs=3)
    for index in range(3):
        store.create(record(f"v{index}", created=NOW + index))
    store.create(record("v3", created=NOW + 3))
    assert sorted(r.id for r in store.all_records()) == ["v1", "v2", "v3"]


def test_a_create_past_the_limit_of_live_jobs_is_refused(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_jobs=2)
    for index in range(2):
        store.create(record(f"v{index}", status=JobStatus.QUEUED, runner=store.runner))
    with pytest.raises(JobLimit, match="limit is 2"):
        store.create(record("v2", status=JobStatus.QUEUED, runner=store.runner))


def test_the_byte_limit_evicts_the_oldest_finished_videos(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_bytes=250)
    for index in range(3):
        job = record(f"v{index}", created=NOW + index, size=100)
        store.create(job)
        store.video_path("", job.id).write_bytes(b"x" * 100)
    store.sweep()
    assert sorted(r.id for r in store.all_records()) == ["v1", "v2"]
    assert not store.video_path("", "v0").exists()


def test_finished_jobs_expire_with_age_but_live_ones_stay(tmp_path: Path) -> None:
    clock = Clock()
    store = store_at(tmp_path, clock, max_age_s=60.0)
    store.create(record("old", created=NOW))
    store.create(record("live", created=NOW, status=JobStatus.IN_PROGRESS, runner=store.runner))
    clock.now = NOW + 61
    store.sweep()
    assert [r.id for r in store.all_records()] == ["live"]


def test_a_job_whose_gateway_died_reads_back_as_failed(tmp_path: Path) -> None:
    """Restart: the record of a gateway process that is gone (same host, dead pid; or a stale
    heartbeat elsewhere) says failed, with an error saying why, and is saved so."""
    before = store_at(tmp_path)
    before.create(record("v1", status=JobStatus.IN_PROGRESS,
                         runner=Runner("this-host", 2**22 + 7, "old")))  # no such pid
    before.partial_path("", "v1").write_bytes(b"half an mp4")
    after = store_at(tmp_path)
    lost = after.get("", "v1")
    assert lost is not None and lost.status is JobStatus.FAILED and lost.error == LOST_ERROR
    assert lost.error_code == "gateway_restarted"
    assert not after.partial_path("", "v1").exists()
    reread = VideoStore(tmp_path).get("", "v1")
    assert reread is not None and reread.status is JobStatus.FAILED


def test_a_restart_in_the_same_process_slot_counts_as_gone(tmp_path: Path) -> None:
    """In a container, a restarted gateway often gets the same pid: a record naming this pid
    but an earlier process start is from the process before, heartbeat or not."""
    store = store_at(tmp_path)
    before = Runner("this-host", os.getpid(), "before", PROCESS_STARTED - 100)
    VideoStore(tmp_path, runner=before).beat()
    store.create(record("v1", status=JobStatus.QUEUED, runner=before))
    lost = store.get("", "v1")
    assert lost is not None and lost.status is JobStatus.FAILED


def test_another_gateway_of_this_process_lives_while_it_beats(tmp_path: Path) -> None:
    store = VideoStore(tmp_path, runner=Runner("this-host", os.getpid(), "me", PROCESS_STARTED))
    sibling = VideoStore(tmp_path, runner=Runner("this-host", os.getpid(), "sibling",
                                                 PROCESS_STARTED))
    sibling.beat()
    store.create(record("v1", status=JobStatus.IN_PROGRESS, runner=sibling.runner))
    assert store.runner_alive(sibling.runner)
    sibling.stop_beating()  # it closed
    assert not store.runner_alive(sibling.runner)


def test_another_hosts_job_lives_while_its_heartbeat_is_fresh(tmp_path: Path) -> None:
    clock = Clock()
    elsewhere = Runner("other-host", 123, "theirs")
    theirs = VideoStore(tmp_path, runner=elsewhere)
    theirs.beat()
    mine = store_at(tmp_path, clock)
    mine.create(record("v1", status=JobStatus.IN_PROGRESS, runner=elsewhere))
    clock.now = os.stat(tmp_path / "gateways" / "theirs").st_mtime + 5
    job = mine.get("", "v1")
    assert job is not None and job.status is JobStatus.IN_PROGRESS
    clock.now += 60  # no beat for a minute: that gateway is gone
    job = mine.get("", "v1")
    assert job is not None and job.status is JobStatus.FAILED


def test_markers_stop_the_runner_at_its_next_write(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    job = record("v1", status=JobStatus.IN_PROGRESS, runner=store.runner)
    store.create(job)
    store.mark_cancelled("", "v1")
    with pytest.raises(JobStopped) as stopped:
        store.save(dataclasses.replace(job, progress=0.5))
    assert not stopped.value.deleted
    store.save(dataclasses.replace(job, status=JobStatus.CANCELLED))  # how it ended: kept
    assert store.get("", "v1") is not None
    store.mark_deleted("", "v1")
    assert store.get("", "v1") is None  # deleted: gone for readers at once
    with pytest.raises(JobStopped) as stopped:
        store.save(job)
    assert stopped.value.deleted


def test_a_malformed_record_is_skipped(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.create(record("good"))
    (tmp_path / "anonymous" / "bad.json").write_text('{"id": 5}')
    assert [r.id for r in store.owned("")] == ["good"]


def test_the_store_lives_in_the_users_cache_unless_told() -> None:
    assert default_root({"STAGEMESH_VIDEO_STORE": "/data/v"}) == Path("/data/v")
    assert default_root({"XDG_CACHE_HOME": "/c"}) == Path("/c/stagemesh/videos")
    assert StoreLimits.from_env({"STAGEMESH_VIDEO_STORE_MAX_JOBS": "5"}).max_jobs == 5
    with pytest.raises(ValueError, match="video store limit"):
        StoreLimits.from_env({"STAGEMESH_VIDEO_STORE_MAX_BYTES": "lots"})
