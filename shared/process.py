"""How a stagemesh process is set up and ended: the cores it may use, its torch threads, its
OpenMP and malloc behaviour, its death with the `stagemesh serve` that started it, and its exit.

The command line (`stagemesh.cli`) only parses and dispatches; the stage command, the stage
launcher (`stagemesh.launcher`) and the benchmarks that imitate a stage call these.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

log = logging.getLogger(__name__)

#: The stages whose compute is most of a request's time: each gets every core this process may
#: use. The others (tokenizer, vae, codec) run short, light work on one thread, so that they
#: never take cores from a heavy stage that shares the machine. The transcriber's decode of a
#: turn is a spoken answer's critical path (it must end inside the turn's closing pause for the
#: answer to start early), and it rarely overlaps the thinker's work on the same turn.
HEAVY_STAGES = frozenset({"dit", "talker", "thinker", "transcriber"})
THREADS_ENV = "STAGEMESH_THREADS"
#: Set by `stagemesh serve` for its children: the pid they must not outlive.
PARENT_PID_ENV = "STAGEMESH_PARENT_PID"
#: linux/prctl.h: deliver a signal to this process when its parent dies.
PR_SET_PDEATHSIG = 1
#: malloc.h: mallopt parameters (glibc).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: A stage's malloc keeps up to this much freed memory for its next step (see
#: `keep_freed_memory`), and serves blocks up to this size from its heaps, not from mmap (32
#: MiB is glibc's largest mmap threshold).
KEPT_FREE_BYTES = 512 << 20
MMAP_THRESHOLD_BYTES = 32 << 20
#: The environment through which an operator tunes glibc's malloc (then we leave it alone).
MALLOC_TUNING_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
#: cgroup v2: a container's CPU limit, as "<quota> <period>" microseconds, or "max <period>".
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def stay_offline() -> None:
    """Nothing in stagemesh may try the network: model hubs are unreachable by design (call
    before huggingface_hub or transformers is imported; an operator's own setting wins)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def usable_cores(cpu_max: Path | None = None) -> int:
    """The CPUs this process may use: those it may run on (its affinity mask: taskset,
    cpusets), at most its cgroup's CPU quota (a container's CPU limit), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = cores or os.cpu_count() or 1
    quota = cgroup_cpu_quota(cpu_max or CGROUP_CPU_MAX)
    return cores if quota is None else min(cores, quota)


def cgroup_cpu_quota(cpu_max: Path) -> int | None:
    """The CPU limit of this process's cgroup in whole CPUs (rounded up); None when unlimited
    or unknown."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def stage_threads(stage: str, given: int | None = None, replicas: int = 1) -> int:
    """A stage's torch threads: `given` (--threads), else $STAGEMESH_THREADS, else by role:
    HEAVY_STAGES share every usable core among the `replicas` of the stage on this machine
    (two DiT replicas with every core each would run twice as many OpenMP threads as there
    are cores, each stalling the other's parallel regions); the others get one."""
    if given is None and os.environ.get(THREADS_ENV):
        try:
            given = int(os.environ[THREADS_ENV])
        except ValueError:
            raise SystemExit(f"{THREADS_ENV} must be a whole number of threads, "
                             f"got {os.environ[THREADS_ENV]!r}") from None
    if given is not None:
        if given < 1:
            raise SystemExit(f"torch threads must be at least 1, got {given}")
        return given
    return max(1, usable_cores() // replicas) if stage in HEAVY_STAGES else 1


def quiet_openmp_waits() -> None:
    """Idle OpenMP threads sleep at once instead of spinning (call before torch is imported).

    libgomp, torch's OpenMP here, lets a thread that finished its part of a parallel region
    spin for a while before it sleeps. Stage processes share cores, so that spinning burns the
    cores another stage (or this stage's gRPC and event-loop threads) is waiting for. An
    operator's own OMP_WAIT_POLICY wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_freed_memory() -> None:
    """Let glibc's malloc keep the memory a step frees for the next step (call before torch
    allocates).

    An engine thread allocates and frees the same activation buffers every step. By default
    glibc gives the free top of a thread's heap, and every block over its (moving) mmap
    threshold, back to the kernel, so the next step faults the same pages in again, zeroed:
    the DiT stage took ~5,000 page faults per step, ~10% of its step time (burst of 8 at
    128 px, `stagemesh bench throughput`); the same loop on a main thread took none. Fixed
    thresholds (KEPT_FREE_BYTES, MMAP_THRESHOLD_BYTES) end that. An operator's own MALLOC_*_
    or GLIBC_TUNABLES win; elsewhere than Linux this does nothing.
    """
    if not sys.platform.startswith("linux") or any(k in os.environ for k in MALLOC_TUNING_ENV):
        return
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                               and mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)):
        log.warning("could not set malloc's thresholds; steps may fault their memory in again")


def die_with_parent() -> None:
    """When `stagemesh serve` started this process ($STAGEMESH_PARENT_PID), ask Linux to send
    it SIGTERM when serve dies, even by `kill -9` (prctl PR_SET_PDEATHSIG), so that no stage
    outlives its supervisor holding its port. If serve is already gone, stop now. Elsewhere
    than Linux this does nothing (serve still stops its children when it exits normally)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if str(os.getppid()) != parent:  # serve died before the prctl took effect
        raise SystemExit(f"stagemesh: parent process {parent} is gone")


def exit_without_teardown(status: int) -> NoReturn:
    """Run the atexit handlers (log and trace flushes), then end the process without the
    interpreter's teardown: freeing a torch stage's modules and tensors one object at a time
    takes ~1 s of CPU, and `serve` stops every stage on the same cores at once (17 by default:
    ~10 s of its Ctrl-C on two cores). Nothing is left to write: the stage has drained."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
