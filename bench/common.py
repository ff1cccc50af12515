"""Helpers shared by the benchmarks: statistics, reports (JSON, Markdown table, PNG chart),
Prometheus scrapes, and a `stagemesh serve` subprocess that never outlives the benchmark.

Benchmarks are not tests: they compare ratios measured in the same run, on whatever machine
runs them, and say how noisy that machine was.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from stagemesh import __version__ as version
from stagemesh.gateway.recipes import COMPANION_TASKS, DEFAULT_RECIPES
from stagemesh.serve import free_port

log = logging.getLogger(__name__)

#: The repository root when running from a checkout (the root *is* the package), else the
#: installed package's folder, which has no git history.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

#: How long `stagemesh serve` may take to build models and start every stage.
SERVE_START_TIMEOUT_S = 300.0
#: How long it may take to stop after SIGINT before its whole process group is killed.
SERVE_STOP_TIMEOUT_S = 30.0


# -- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated linearly between ranks like numpy's default."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float | int]:
    """n, mean, p50, p99, min, max and the coefficient of variation (stdev / mean, in %)."""
    if not values:
        return {"n": 0}
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "n": len(values),
        "mean": mean,
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
        "cv_pct": 100 * spread / mean if mean else 0.0,
    }


def overhead_pct(measured: float, baseline: float) -> float:
    """(measured - baseline) / baseline, in percent."""
    if baseline <= 0:
        raise ValueError(f"baseline must be positive, got {baseline}")
    return 100 * (measured - baseline) / baseline


# -- reports ----------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; every row must have one cell per header."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells for {len(headers)} headers")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


@dataclass(frozen=True)
class BarGroup:
    """One panel of grouped bars: a bar per series for each category."""

    title: str
    ylabel: str
    categories: Sequence[str]
    series: Mapping[str, Sequence[float]]  # series name -> one value per category
    labels: Sequence[str] = ()  # optional text above each category


def write_bar_chart(path: Path, panels: Sequence[BarGroup], suptitle: str = "") -> Path:
    """A PNG with one grouped bar chart per panel, side by side (matplotlib, Agg backend)."""
    try:
        import matplotlib
    except ModuleNotFoundError as error:  # the `bench` extra: the runtime does not need it
        raise ModuleNotFoundError("benchmark charts need matplotlib: "
                                  "pip install 'stagemesh[bench]'") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        _draw_bars(ax, panel)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_bars(ax: Any, panel: BarGroup) -> None:
    width = 0.8 / max(1, len(panel.series))
    for index, (name, values) in enumerate(panel.series.items()):
        offsets = [c + (index - (len(panel.series) - 1) / 2) * width
                   for c in range(len(panel.categories))]
        ax.bar(offsets, values, width, label=name)
    for category, text in enumerate(panel.labels):
        top = max((values[category] for values in panel.series.values()), default=0.0)
        ax.annotate(text, (category, top), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(panel.categories)), panel.categories, fontsize=8)
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)


# -- machine and timing -----------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: the CPU (a shared VM's host changes between days, and
    with it every ratio: bf16 is fast only where the CPU has bf16 instructions), CPU count and
    load (other work skews every timing), and the code (`source_revision`), so that a number can
    be traced to the commit it states."""
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
            "python": sys.version.split()[0], "source": source_revision()}


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux), else what the platform says."""
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or platform.machine()


def source_revision(root: Path = PACKAGE_ROOT) -> dict[str, Any]:
    """The code the benchmark ran: `{"commit": sha, "dirty": bool}` in a git checkout (dirty:
    tracked files differ from the commit; untracked scratch files do not count), else
    `{"version": ...}` of the installed package (also when that sits inside someone else's
    repository, e.g. a virtual environment in a checkout)."""
    if not (root / ".git").exists():  # a folder (a clone) or a file (a worktree)
        return {"version": version}
    try:
        commit = _git(root, "rev-parse", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return {"version": version}
    return {"commit": commit, "dirty": bool(changed)}


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


def recipe_file_with_companions(path: Path, name: str) -> Path:
    """Write to `path` a recipe file holding the default recipe `name` and the recipes it names
    as companions (its voice, its listener), so that `serve` starts those stages and no others."""
    document = yaml.safe_load(DEFAULT_RECIPES.read_text())
    recipe = next(r for r in document["recipes"] if r["name"] == name)
    wanted = {name} | {recipe[key] for key in COMPANION_TASKS if recipe.get(key)}
    path.write_text(yaml.safe_dump({"recipes": [r for r in document["recipes"]
                                                if r["name"] in wanted]}))
    return path


def interrupt_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt like Ctrl-C, so `finally` blocks stop the mesh."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


class Stopwatch:
    """Seconds since it was started, on the monotonic high-resolution clock."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


# -- Prometheus ---------------------------------------------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Prometheus text format -> {(sample name, sorted labels): value}."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and wanted <= set(sample_labels))


async def scrape(client: httpx.AsyncClient, url: str) -> Samples:
    response = await client.get(url)
    response.raise_for_status()
    return parse_metrics(response.text)


# -- the mesh under test --------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """A running `stagemesh serve`: where its REST gateway listens."""

    base_url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def serve_mesh(recipes: Path, log_path: Path, env: Mapping[str, str] | None = None,
               host: str = "127.0.0.1") -> Iterator[Mesh]:
    """Run `stagemesh serve` on free ports until the block ends, then stop it and its stages.

    The server runs in its own session, so a Ctrl-C in the terminal reaches only the benchmark,
    whose `finally` then stops the server (see `stop_mesh`); whatever is left after the grace
    period is killed as a process group, so no stage outlives the run.
    """
    http_port, grpc_port = free_port(host), free_port(host)
    command = [sys.executable, "-m", "stagemesh", "serve", "--recipes", str(recipes),
               "--stage-ports", "auto", "--host", host, "--http-port", str(http_port),
               "--grpc-port", str(grpc_port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as server_log:
        process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
    log.info("started `stagemesh serve` (pid %d), logging to %s", process.pid, log_path)
    try:
        mesh = Mesh(f"http://{host}:{http_port}", process)
        wait_healthy(mesh)
        yield mesh
    finally:
        stop_mesh(process)


def wait_healthy(mesh: Mesh, timeout: float = SERVE_START_TIMEOUT_S) -> None:
    """Poll GET /health until every stage is SERVING; fail fast if the server exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mesh.process.poll() is not None:
            raise RuntimeError(f"`stagemesh serve` exited with code {mesh.process.returncode} "
                               "during start-up; see its log")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{mesh.base_url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"`stagemesh serve` not healthy after {timeout:.0f} s")


def stop_mesh(process: subprocess.Popen[bytes], timeout: float = SERVE_STOP_TIMEOUT_S) -> None:
    """SIGTERM to serve (it stops the gateway, then its stages; during start-up it just dies),
    then SIGTERM and, after the grace period, SIGKILL to whatever is left of its process group.

    Not SIGINT: a process started in the background by a shell inherits SIGINT ignored, and
    serve only handles it itself once the gateway runs.
    """
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("`stagemesh serve` did not stop in %.0f s; killing it", timeout)
            process.kill()
            process.wait()
    # serve leads its own session, so its process group holds exactly the stages it started.
    stop_process_group(process.pid, timeout)
    log.info("`stagemesh serve` stopped (exit code %s)", process.returncode)


def stop_process_group(pgid: int, timeout: float) -> None:
    """SIGTERM every process of a group, then SIGKILL those still there after `timeout`."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the group is empty
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    log.warning("process group %d still alive after %.0f s; killing it", pgid, timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
