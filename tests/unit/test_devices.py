"""The `device` and `dtype` stage options: resolved and checked once at start-up, no model loaded.

This machine has no CUDA device, so `device: cuda` must stop a stage with a message naming the
option; CUDA being present is simulated where a test needs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stagemesh.services.registry import STAGE_BUILDERS, build_stage
from stagemesh.shared import devices
from stagemesh.shared.devices import (
    CPU_FLOAT32,
    CpuDtype,
    DeviceOptions,
    LaunchPacer,
    Placement,
    cpu_has_native_bf16,
    resolve_device,
    resolve_placement,
    synchronize,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the tests assume no CUDA")

NATIVE_BF16 = CpuDtype(with_native_bf16=torch.bfloat16)
X86_FLAGS = "fpu vme avx2 avx512f avx512bw"


def _cpuinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "native"), [
    (f"processor\t: 0\nflags\t\t: {X86_FLAGS} avx512_bf16 amx_tile\n", True),
    (f"processor\t: 0\nflags\t\t: {X86_FLAGS} amx_bf16\n", True),
    (f"processor\t: 0\nflags\t\t: {X86_FLAGS} avx512_vnni\n", False),
    ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),  # Arm (e.g. Graviton 3)
    ("processor\t: 0\nFeatures\t: fp asimd\n", False),
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path, text: str, native: bool) -> None:
    assert cpu_has_native_bf16(_cpuinfo(tmp_path, text)) is native


def test_without_cpuinfo_the_cpu_counts_as_without_bf16(tmp_path: Path) -> None:
    assert cpu_has_native_bf16(tmp_path / "missing") is False


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_default_is_the_stages_choice_for_this_kind_of_cpu(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    placement = resolve_placement("vae", {}, NATIVE_BF16)
    assert placement == Placement(torch.device("cpu"), torch.bfloat16 if native else torch.float32)
    assert CpuDtype(with_native_bf16=torch.float32).pick() is torch.float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_computes_on_this_cpu(dtype: str) -> None:
    placement = resolve_placement("dit", {"device": "cpu", "dtype": dtype}, NATIVE_BF16)
    assert (placement.device_name, placement.dtype_name) == ("cpu", dtype)
    assert placement.facts() == {"device": "cpu", "dtype": dtype}


def test_a_named_dtype_wins_over_the_default() -> None:
    assert resolve_placement("vae", {"dtype": "float32"}, NATIVE_BF16) == CPU_FLOAT32


@pytest.mark.parametrize("name", ["float64", "bf16", "FLOAT32", "int8"])
def test_an_unknown_dtype_names_the_stage_the_option_and_the_choices(name: str) -> None:
    with pytest.raises(ValueError, match=r"stage dit: option 'dtype' must be one of "
                                         r"\['bfloat16', 'float16', 'float32'\]"):
        resolve_placement("dit", {"dtype": name}, NATIVE_BF16)


@pytest.mark.parametrize("name", ["cpu", "cpu:0"])
def test_the_cpu_is_always_there(name: str) -> None:
    assert resolve_device("vae", name) == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3", "mps", "xpu:0", "cpu:1"])
def test_an_absent_device_names_the_stage_the_option_and_what_is_available(name: str) -> None:
    with pytest.raises(ValueError, match=rf"stage talker: option 'device' is '{name}', but "
                                         r"this machine has no such device \(available: cpu"):
        resolve_device("talker", name)


def test_cuda_on_a_cpu_only_torch_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="has no CUDA support"):
        resolve_device("dit", "cuda")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", ""])
def test_a_name_that_is_no_device_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=rf"stage dit: option 'device' '{name}' is not a device"):
        resolve_device("dit", name)


def test_a_dtype_the_device_cannot_compute_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_computes", lambda device, dtype: dtype == torch.float32)
    with pytest.raises(ValueError, match=r"stage vae: option 'dtype' is 'float16', which cpu "
                                         r"does not compute; use float32"):
        resolve_placement("vae", {"dtype": "float16"}, NATIVE_BF16)


def test_with_cuda_the_default_is_its_current_device_in_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "_native_bf16", lambda device: device.type == "cuda")
    placement = resolve_placement("dit", {}, CpuDtype(with_native_bf16=torch.float32))
    assert (placement.device_name, placement.dtype_name) == ("cuda:0", "bfloat16")


def test_with_cuda_lacking_bf16_the_default_is_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "_native_bf16", lambda device: False)
    placement = resolve_placement("dit", {}, NATIVE_BF16)
    assert (placement.device_name, placement.dtype_name) == ("cuda:0", "float32")


def test_the_outcome_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    options: DeviceOptions = {"device": "cpu"}
    with caplog.at_level("INFO", logger="stagemesh.shared.devices"):
        resolve_placement("codec", options, CpuDtype(with_native_bf16=torch.float32))
    (line,) = caplog.messages
    assert line.startswith("stage codec computes on cpu (set by option) in float32 (default: ")


@pytest.mark.parametrize("stage", sorted(STAGE_BUILDERS))
@pytest.mark.parametrize(("options", "message"), [
    ({"device": "cuda"}, "option 'device' is 'cuda'"),
    ({"dtype": "float64"}, "option 'dtype' must be one of"),
    ({"device": 0}, "option 'device' must be str"),
])
def test_every_stage_checks_device_and_dtype_before_loading_its_model(
    stage: str, options: dict[str, object], message: str
) -> None:
    # The folder does not exist: only the device check can have raised.
    with pytest.raises(ValueError, match=rf"stage {stage}: {message}"):
        build_stage(stage, Path("/nonexistent/model"), options)


def test_a_stage_asked_for_cuda_here_exits_non_zero_naming_the_option() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stagemesh", "stage", "vae", "--port", "0",
         "--model", "builtin:tiny-shapes", "--options", '{"device": "cuda"}'],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "stage vae: option 'device' is 'cuda', but this machine has no such device" in (
        result.stderr)


class FakeMarker:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def record(self) -> None:
        self.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


def test_the_pacer_waits_for_the_mark_two_back() -> None:
    log: list[str] = []
    names = iter("abcde")
    pacer = LaunchPacer(torch.device("cpu"), ahead=2,
                        new_marker=lambda: FakeMarker(log, next(names)))
    for _ in range(4):
        pacer.mark()
    assert log == ["record a", "record b", "record c", "wait a", "record d", "wait b"]
    pacer.reset()
    pacer.mark()
    assert log[-1] == "record e"  # nothing left to wait for after a reset


def test_on_the_cpu_pacing_and_synchronizing_do_nothing() -> None:
    pacer = LaunchPacer(torch.device("cpu"))
    for _ in range(5):
        pacer.mark()
    synchronize(torch.device("cpu"))
