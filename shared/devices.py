"""Where a stage computes and in what dtype: the `device` and `dtype` stage options.

Every torch stage takes the same two recipe options, resolved here once at start-up:

- `device`: `cpu`, `cuda`, `cuda:N`, or any other device torch reports on this machine
  (`mps`, `xpu:N`, ...). Default: the first CUDA device when torch sees one, else the CPU.
- `dtype`: `float32`, `bfloat16` or `float16`. Default: `bfloat16` on an accelerator that
  computes it natively; on the CPU the stage's own measured choice (`CpuDtype`), which depends
  on whether the CPU has bfloat16 instructions.

A device this machine lacks, or a dtype the device cannot compute, is a ValueError naming the
stage and the option: the stage stops before it loads anything, with that message.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict

import torch

log = logging.getLogger(__name__)

#: The dtype names the `dtype` option takes, as torch names them.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
#: CPU feature flags (/proc/cpuinfo) of native bfloat16 arithmetic: x86 AVX512-BF16 and AMX,
#: Arm's BF16 extension (listed as `bf16` under Features).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPUINFO = Path("/proc/cpuinfo")


class DeviceOptions(TypedDict, total=False):
    """The `device` and `dtype` recipe options every torch stage takes."""

    device: str  # "cpu", "cuda", "cuda:1", "mps", ...
    dtype: str  # "float32", "bfloat16", "float16"


@dataclass(frozen=True)
class Placement:
    """Where a stage's model lives and computes, and in what dtype."""

    device: torch.device  # with its index for an accelerator ("cuda:0", never "cuda")
    dtype: torch.dtype

    @property
    def device_name(self) -> str:
        return str(self.device)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def facts(self) -> dict[str, str]:
        """For the stage's start-up log line and StageBundle.info."""
        return {"device": self.device_name, "dtype": self.dtype_name}


#: What `from_pretrained` gives without options: the weights on the CPU in float32. The
#: adapters' default, so a bare adapter (tests, tools) computes as the stock pipelines do.
CPU_FLOAT32 = Placement(torch.device("cpu"), torch.float32)


@dataclass(frozen=True)
class CpuDtype:
    """A stage's default dtype on the CPU, by whether the CPU computes bfloat16 natively.

    Each stage measures both (`stagemesh bench dtypes`) and records the outcome, with its
    numbers, beside its `CPU_DTYPE`. With AVX512-BF16 / AMX, bfloat16 products run in
    hardware; without, they are emulated around float32 arithmetic, which only costs.
    """

    with_native_bf16: torch.dtype
    without: torch.dtype = torch.float32

    def pick(self) -> torch.dtype:
        return self.with_native_bf16 if cpu_has_native_bf16() else self.without


def cpu_has_native_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether the CPU has bfloat16 instructions (read from /proc/cpuinfo; False elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return not flags.isdisjoint(BF16_CPU_FLAGS)


def synchronize(device: torch.device) -> None:
    """Wait until the device has done the work queued on it (nothing to wait for on the CPU).

    An accelerator runs work asynchronously: without this, a step "ends" when its kernels are
    queued, so step times, progress events and step-boundary aborts would run ahead of it.
    """
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class Marker(Protocol):
    """What LaunchPacer needs of a device event (torch.Event)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class LaunchPacer:
    """Keeps the host at most `ahead` marks ahead of an accelerator (a no-op on the CPU).

    The host queues work on an accelerator and moves on long before the device has done it, so
    a check the host makes between blocks of a forward (the DiT's mid-step interrupt) sees the
    future, not the present: by the time it would stop, every block is already queued. Marking
    each block and waiting for the mark `ahead` blocks back keeps that many blocks queued
    (enough to keep the device busy) and a check at most that far ahead of the device.
    """

    def __init__(self, device: torch.device, ahead: int = 2,
                 new_marker: Callable[[], Marker] | None = None) -> None:
        self._ahead = ahead
        self._new_marker = new_marker or (lambda: torch.Event(device=device))
        self._active = device.type != "cpu" or new_marker is not None
        self._marks: deque[Marker] = deque()

    def mark(self) -> None:
        """Record the work queued so far; wait for the mark `ahead` marks back."""
        if not self._active:
            return
        marker = self._new_marker()
        marker.record()
        self._marks.append(marker)
        while len(self._marks) > self._ahead:
            self._marks.popleft().synchronize()

    def reset(self) -> None:
        """Forget the marks (after the device has been synchronized, e.g. at a step's end)."""
        self._marks.clear()


def cpu_threads(threads: int | None = None) -> int:
    """`threads`, or the stage process's share of cores: `stagemesh stage --threads` sets it on
    torch, and a runtime other than torch's (ONNX Runtime) takes the same share."""
    return torch.get_num_threads() if threads is None else threads


def available_devices() -> list[str]:
    """The devices a stage may name here: the CPU, then each device of torch's accelerator."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        return ["cpu"]
    count = torch.accelerator.device_count()
    return ["cpu", *(f"{accelerator.type}:{index}" for index in range(count))]


def resolve_placement(stage: str, options: DeviceOptions, cpu_dtype: CpuDtype) -> Placement:
    """The stage's placement from its options (absent = the defaults above), checked against
    this machine; logs the outcome and why. Raises ValueError naming stage and option."""
    device = resolve_device(stage, options.get("device"))
    requested = options.get("dtype")
    if requested is None:
        dtype, why = _default_dtype(device, cpu_dtype)
    else:
        dtype, why = _named_dtype(stage, requested), "set by option"
        _check_dtype_support(stage, device, dtype)
    placement = Placement(device, dtype)
    device_why = "set by option" if "device" in options else "default"
    log.info("stage %s computes on %s (%s) in %s (%s)", stage, placement.device_name,
             device_why, placement.dtype_name, why)
    return placement


def resolve_device(stage: str, requested: str | None) -> torch.device:
    """`requested` as a torch device with its index, if this machine has it."""
    if requested is None:
        return _indexed(torch.device("cuda")) if torch.cuda.is_available() else CPU_FLOAT32.device
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise ValueError(
            f"stage {stage}: option 'device' {requested!r} is not a device name ({error})"
        ) from None
    if device.type == "cpu" and device.index in (None, 0):
        return torch.device("cpu")
    indexed = _indexed(device)
    available = available_devices()
    if str(indexed) not in available:
        build = "" if torch.version.cuda else f"; torch {torch.__version__} has no CUDA support"
        raise ValueError(
            f"stage {stage}: option 'device' is {requested!r}, but this machine has no such "
            f"device (available: {', '.join(available)}{build})"
        )
    return indexed


def _indexed(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:<current>`: the published name says which device it is."""
    index: int | None = device.index  # None for a bare `cuda` (torch's stubs say int)
    if index is not None or device.type == "cpu":
        return device
    current = torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0
    return torch.device(device.type, current)


def _named_dtype(stage: str, name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(
            f"stage {stage}: option 'dtype' must be one of {sorted(DTYPES)}, got {name!r}"
        )
    return DTYPES[name]


def _default_dtype(device: torch.device, cpu_dtype: CpuDtype) -> tuple[torch.dtype, str]:
    if device.type == "cpu":
        kind = "with" if cpu_has_native_bf16() else "without"
        return cpu_dtype.pick(), f"default: this stage's faster dtype on a CPU {kind} bfloat16"
    if _native_bf16(device):
        return torch.bfloat16, "default on an accelerator"
    return torch.float32, f"default: {device} has no native bfloat16"


def _native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        with torch.cuda.device(device):
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return _computes(device, torch.bfloat16)


def _check_dtype_support(stage: str, device: torch.device, dtype: torch.dtype) -> None:
    """A dtype the device cannot compute fails here, not on the first request."""
    native_only = dtype == torch.bfloat16 and device.type == "cuda"
    supported = _native_bf16(device) if native_only else _computes(device, dtype)
    if not supported:
        raise ValueError(
            f"stage {stage}: option 'dtype' is {DTYPE_NAMES[dtype]!r}, which {device} does "
            "not compute; use float32" + ("" if dtype == torch.float16 else " or float16")
        )


def _computes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a small matrix product and convolution run on `device` in `dtype`."""
    try:
        matrix = torch.ones((4, 4), device=device, dtype=dtype)
        signal = torch.ones((1, 2, 8), device=device, dtype=dtype)
        kernel = torch.ones((2, 2, 3), device=device, dtype=dtype)
        product = (matrix @ matrix).sum() + torch.nn.functional.conv1d(signal, kernel).sum()
        return bool(torch.isfinite(product).item())
    except (RuntimeError, TypeError, NotImplementedError):
        return False
