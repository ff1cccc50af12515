"""`stagemesh bench startup`'s plan and report (the starts themselves are timed by running it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.bench.startup import WAYS, Options, parse, report, round_order


def test_the_ways_alternate_which_goes_first() -> None:
    launcher, spawn = list(WAYS)
    assert [round_order(i) for i in range(3)] == [
        [launcher, spawn], [spawn, launcher], [launcher, spawn]]
    assert set(WAYS.values()) == {"fork", "spawn"}


def test_the_report_gives_medians_and_their_ratio() -> None:
    launcher, spawn = list(WAYS)
    options = Options(Path("recipes.yaml"), 3, Path("out"))
    result = report(options, {launcher: [10.0, 8.0, 9.0], spawn: [50.0, 60.0, 55.0]}, {}, {})
    assert result["spawn_over_launcher"] == pytest.approx(55.0 / 9.0)
    assert f"| {launcher} | 3 | 9.0 | 8.0 | 10.0 |" in result["table"]
    assert f"| {spawn} | 3 | 55.0 | 50.0 | 60.0 |" in result["table"]


def test_rounds_below_one_are_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err
