"""`stagemesh bench voice --dry-run`: the report and chart of every phase, starting nothing."""

from __future__ import annotations

import json
from pathlib import Path

from stagemesh.bench import voice
from stagemesh.commands.bench import bench_names


def test_the_voice_dry_run_reports_every_phase(tmp_path: Path) -> None:
    assert "voice" in bench_names()
    voice.main(["--dry-run", "--concurrency", "1,4", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "voice.json").read_text())
    assert report["dry_run"] is True and report["levels"] == [1, 4]
    assert len(report["machine"]["load_average"]) == 3
    for level, sessions in (("c1", 1), ("c4", 4)):
        result = report["results"][level]
        assert result["concurrency"] == sessions
        assert all(result[phase]["n"] == 3 * sessions for phase in voice.PHASES)
        assert result["barge_in_last_delta_s"]["n"] == sessions
        # Where the time went, in units that do not depend on the load, per turn too.
        assert result["vad_lag_ms"]["n"] == result["first_piece_tokens"]["n"] == 3 * sessions
        assert len(result["turns"]) == 3 * sessions and result["turns"][0]["first_piece"]
        assert {"speculative_answers", "answers_at_confirmation", "speculations_dropped",
                "speculation_lead_s_mean"} <= set(result)
    assert (tmp_path / "voice.png").stat().st_size > 1000
