"""The device benchmarks, on this CPU: `stagemesh bench gpu --dry-run` checks everything but the
GPU (the real-size model's configuration on the meta device, every measurement with a tiny
model, the parallel arms as groups of CPU ranks), and `stagemesh bench dtypes` times a stage in
both dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stagemesh.bench import dtypes, gpu

pytestmark = pytest.mark.timeout(300)

#: Qwen/Qwen-Image's transformer: 60 blocks, 24 heads x 128, text width 3584.
QWEN_IMAGE_PARAMETERS = 20_430_401_088


def test_the_gpu_dry_run_measures_every_section(tmp_path: Path) -> None:
    gpu.main(["--dry-run", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["dry_run"] is True and report["device"] == {"device": "cpu"}
    assert report["dtype"] == "bfloat16"
    assert report["real_size_parameters"] == QWEN_IMAGE_PARAMETERS
    assert report["skipped"] == []
    (step_time,) = report["step_time"]
    assert step_time["size"] == 64 and step_time["step_seconds"]["n"] == 5
    (batching,) = report["batching"]
    assert [row["batch"] for row in batching["rows"]] in ([1], [1, 2])
    assert batching["ceiling_batch"] in (1, 2)
    (abort,) = report["abort_latency"]
    assert abort["step_boundary"]["n"] == abort["mid_step"]["n"] == 2
    (post_abort,) = report["post_abort"]
    rows = {row["configuration"]: row for row in post_abort["rows"]}
    assert rows["baseline (B alone)"]["a_outcome"] == "none"
    assert rows["no abort (A runs on)"]["a_outcome"] == "completed"
    assert rows["no abort (A runs on)"]["a_steps"] == post_abort["steps"]
    assert rows["abort waiting + running (step mode)"]["a_outcome"] == "aborted"
    # the parallel arms: one device, then groups of 2 CPU ranks on fresh copies of the model
    arms = {row["arm"]: row for row in report["parallel"]}
    assert list(arms) == ["one-device", "cfg2", "ulysses2"]
    assert [arms[arm]["ranks"] for arm in arms] == [1, 2, 2]
    assert all(row["size"] == 64 and row["step_seconds"] > 0 for row in arms.values())
    assert arms["one-device"]["speedup"] == pytest.approx(1.0)
    assert arms["cfg2"]["speedup"] == pytest.approx(
        arms["one-device"]["step_seconds"] / arms["cfg2"]["step_seconds"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_gpu_run_without_a_gpu_says_so() -> None:
    with pytest.raises(SystemExit, match=r"option 'device' is 'cuda', but this machine has no "
                                         r"such device.*--dry-run"):
        gpu.main(["--device", "cuda"])


def test_a_shrunk_real_model_keeps_its_width() -> None:
    assert gpu.parameter_count(gpu.DitConfig(num_layers=1)) < QWEN_IMAGE_PARAMETERS // 50


def test_the_dtype_bench_times_a_stage_in_both_dtypes(tmp_path: Path) -> None:
    dtypes.main(["--stages", "vae", "--rounds", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "dtypes.json").read_text())
    (vae,) = report["results"].values()
    assert vae["float32"] > 0 and vae["bfloat16"] > 0
    assert vae["bf16_speedup_best"] == pytest.approx(vae["float32"] / vae["bfloat16"])
    assert isinstance(report["cpu_has_native_bf16"], bool)
