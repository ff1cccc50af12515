"""The benchmark helpers that turn samples into reports: percentiles, summaries, tables, metrics,
and the PNG chart (written with the Agg backend, no display)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from stagemesh.bench.common import (
    BarGroup,
    cpu_model,
    machine_info,
    markdown_table,
    metric_value,
    overhead_pct,
    parse_metrics,
    percentile,
    recipe_file_with_companions,
    source_revision,
    summarize,
    write_bar_chart,
    write_json,
)
from stagemesh.gateway.recipes import load_recipes


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0, 1.0), (50, 2.5), (100, 4.0), (25, 1.75), (99, 3.97)],
)
def test_percentile_interpolates_between_ranks_like_numpy(q: float, expected: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_of_one_value_is_that_value() -> None:
    assert percentile([7.5], 99) == 7.5


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_rejects_q_outside_0_100(q: float) -> None:
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], q)


def test_percentile_rejects_no_values() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_summarize_reports_centre_spread_and_count() -> None:
    stats = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert stats["n"] == 5
    assert stats["mean"] == pytest.approx(4.0)
    assert stats["p50"] == pytest.approx(3.0)
    assert stats["min"] == 1.0 and stats["max"] == 10.0
    assert stats["cv_pct"] == pytest.approx(100 * math.sqrt(12.5) / 4.0)


def test_summarize_of_one_value_has_no_spread_and_of_none_only_a_count() -> None:
    assert summarize([2.0])["cv_pct"] == 0.0
    assert summarize([]) == {"n": 0}


def test_overhead_is_relative_to_baseline_in_percent() -> None:
    assert overhead_pct(15.0, 10.0) == pytest.approx(50.0)
    assert overhead_pct(9.0, 10.0) == pytest.approx(-10.0)
    with pytest.raises(ValueError, match="positive"):
        overhead_pct(1.0, 0.0)


def test_markdown_table_has_header_separator_and_rows() -> None:
    text = markdown_table(["a", "b"], [[1, "x"], [2.5, "y"]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | y |"]


def test_markdown_table_rejects_a_row_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="3 cells for 2 headers"):
        markdown_table(["a", "b"], [[1, 2, 3]])


METRICS_TEXT = """\
# HELP stagemesh_requests_finished_total Requests that left the engine
# TYPE stagemesh_requests_finished_total counter
stagemesh_requests_finished_total{stage="dit",status="completed"} 3.0
stagemesh_requests_finished_total{stage="dit",status="aborted"} 2.0
# HELP stagemesh_abort_latency_seconds From the abort signal to the state's release
# TYPE stagemesh_abort_latency_seconds histogram
stagemesh_abort_latency_seconds_bucket{le="0.1",stage="dit"} 1.0
stagemesh_abort_latency_seconds_bucket{le="+Inf",stage="dit"} 2.0
stagemesh_abort_latency_seconds_count{stage="dit"} 2.0
stagemesh_abort_latency_seconds_sum{stage="dit"} 0.35
"""


def test_metric_value_selects_by_name_and_labels_and_sums_the_rest() -> None:
    samples = parse_metrics(METRICS_TEXT)
    assert metric_value(samples, "stagemesh_requests_finished_total", status="aborted") == 2.0
    assert metric_value(samples, "stagemesh_requests_finished_total") == 5.0
    assert metric_value(samples, "stagemesh_abort_latency_seconds_sum") == pytest.approx(0.35)
    assert metric_value(samples, "stagemesh_requests_finished_total", stage="vae") == 0.0


def test_write_json_creates_folders_and_round_trips(tmp_path: Path) -> None:
    path = write_json(tmp_path / "deep" / "r.json", {"a": [1, 2.5], "b": None})
    assert json.loads(path.read_text()) == {"a": [1, 2.5], "b": None}


def test_bar_chart_is_a_png(tmp_path: Path) -> None:
    panel = BarGroup("latency", "s", ["x", "y"], {"baseline": [1.0, 2.0], "post": [1.5, 2.0]},
                     labels=["+50%", "+0%"])
    path = write_bar_chart(tmp_path / "chart.png", [panel, panel], suptitle="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as chart:
        # Two panels of 6.5 x 4.8 inches at 110 dpi, drawn (not a blank canvas).
        assert chart.size == (1430, 528)
        assert len(chart.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], capture_output=True, text=True, check=True).stdout.strip()


def test_a_report_names_the_commit_it_ran_on_and_whether_tracked_files_changed(
    tmp_path: Path,
) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "first")
    head = _git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "scratch.txt").write_text("untracked")  # scratch files do not make it dirty
    assert source_revision(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_revision(tmp_path) == {"commit": head, "dirty": True}


def test_outside_a_checkout_a_report_names_the_package_version(tmp_path: Path) -> None:
    from stagemesh import __version__

    assert source_revision(tmp_path) == {"version": __version__}


def test_machine_info_carries_the_source_of_this_checkout() -> None:
    source = machine_info()["source"]
    assert set(source) in ({"commit", "dirty"}, {"version"})
    if "commit" in source:
        assert len(source["commit"]) == 40 and isinstance(source["dirty"], bool)


def test_a_benchmark_recipe_file_carries_the_voice_and_listener_its_chat_recipe_names(
        tmp_path: Path) -> None:
    # The chat bench once wrote the chat recipe without its listener, and `serve` refused it.
    recipes = load_recipes(recipe_file_with_companions(tmp_path / "recipes.yaml", "smollm2"))
    chat = recipes["smollm2"]
    assert chat.speech and chat.listen
    assert set(recipes) == {"smollm2", chat.speech, chat.listen}


def test_the_cpu_model_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n")
    assert cpu_model(cpuinfo) == "AMD EPYC"
    assert machine_info()["cpu"]  # this machine's, whatever it is
