"""LoRA adapters of the DiT stage: the options, the directory of adapter files, a request's use.

An adapter is a sub-directory of `lora_dir` holding what diffusers' `save_lora_weights` writes
(`pytorch_lora_weights.safetensors`), or a single `<name>.safetensors`; its name is the
directory's or the file's stem. Its rank (the largest `lora_A` row count) and the modules it
targets are read from the safetensors header before any tensor loads, so a file too large for
the stage's slots is refused at start, not when a request names it. Symlinks are resolved and
must stay inside the directory (a link out of it is skipped, and refused if asked for by path).

The per-row product that applies the adapters lives in `services/dit/lora_slots.py`.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from stagemesh.shared.engine.adapter import InvalidInputError

logger = logging.getLogger(__name__)

#: The file diffusers' `save_lora_weights` writes into an adapter's directory.
WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
SUFFIX = ".safetensors"
#: The request field every refusal names (wire, gateway, REST).
FIELD = "lora"
#: The most bytes a safetensors header may take before it is refused as malformed.
MAX_HEADER_BYTES = 64 << 20
#: Key parts of a low-rank pair's down (A) and up (B) matrices in diffusers/PEFT layout.
DOWN, UP = ".lora_A.", ".lora_B."


class LoraOptions(TypedDict, total=False):
    """The DiT's LoRA options (flat, published in Describe)."""

    lora_dir: str  # the adapters a request may name; unset = LoRA off
    max_loras: int  # adapters resident at once (the slots of every LoRA'd Linear)
    max_lora_rank: int  # slots are padded to this rank; a file of a larger rank is refused
    max_loras_per_request: int
    max_lora_scale: float  # the largest |scale| a request may set
    #: true = LoadLoraAdapter/UnloadLoraAdapter change the adapters at run time (needs lora_dir)
    runtime_lora_updates: bool


@dataclass(frozen=True)
class LoraConfig:
    """The stage's LoRA setting (its options, checked); `directory` None = off."""

    directory: Path | None = None
    max_loras: int = 8
    max_lora_rank: int = 64
    max_loras_per_request: int = 4
    max_lora_scale: float = 4.0
    runtime_updates: bool = False

    @classmethod
    def from_options(cls, options: LoraOptions) -> LoraConfig:
        """The options, checked; a bad one raises ValueError naming it."""
        default = cls()
        directory = options.get("lora_dir")
        config = cls(
            directory=None if directory is None else Path(directory).resolve(),
            max_loras=options.get("max_loras", default.max_loras),
            max_lora_rank=options.get("max_lora_rank", default.max_lora_rank),
            max_loras_per_request=options.get(
                "max_loras_per_request", default.max_loras_per_request
            ),
            max_lora_scale=float(options.get("max_lora_scale", default.max_lora_scale)),
            runtime_updates=options.get("runtime_lora_updates", default.runtime_updates),
        )
        for name, value in (
            ("max_loras", config.max_loras),
            ("max_lora_rank", config.max_lora_rank),
            ("max_loras_per_request", config.max_loras_per_request),
        ):
            if value < 1:
                raise ValueError(f"option {name} must be at least 1, got {value}")
        if config.max_loras_per_request > config.max_loras:
            raise ValueError("option max_loras_per_request must not exceed max_loras")
        if not (math.isfinite(config.max_lora_scale) and config.max_lora_scale > 0):
            raise ValueError(f"option max_lora_scale must be > 0, got {config.max_lora_scale}")
        if config.directory is not None and not config.directory.is_dir():
            raise ValueError(f"option lora_dir: {directory} is not a directory")
        if config.runtime_updates and config.directory is None:
            raise ValueError("option runtime_lora_updates needs lora_dir (the only place "
                             "adapters are loaded from)")
        return config

    @property
    def enabled(self) -> bool:
        return self.directory is not None


@dataclass(frozen=True)
class LoraUse:
    """One adapter a request runs under, at its scale (diffusers' `set_adapters` weight)."""

    name: str
    scale: float = 1.0


@dataclass(frozen=True)
class AdapterFile:
    """An adapter found in `lora_dir`: its weights file (resolved), rank and target modules
    (the transformer's module names, without the `transformer.` prefix)."""

    name: str
    path: Path
    rank: int
    targets: frozenset[str] = field(default_factory=frozenset)


def read_header(path: Path) -> dict[str, object]:
    """A safetensors file's JSON header (tensor names -> dtype/shape/offsets), no tensor read."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path.name}: not a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name}: safetensors header of {length} bytes")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: malformed safetensors header")
    return header


def inspect(name: str, path: Path) -> AdapterFile:
    """The adapter's rank and targets from its header (diffusers/PEFT `lora_A`/`lora_B` keys)."""
    rank, targets = 0, set()
    for key, entry in read_header(path).items():
        if DOWN not in key or not isinstance(entry, dict):
            continue
        shape = entry.get("shape")
        if not isinstance(shape, list) or len(shape) != 2:
            raise ValueError(f"{path.name}: {key} is not a matrix")
        rank = max(rank, int(shape[0]))
        module = key.split(DOWN)[0]
        targets.add(module.removeprefix("transformer."))
    if not targets:
        raise ValueError(f"{path.name}: no lora_A weights (diffusers/PEFT layout expected)")
    return AdapterFile(name, path, rank, frozenset(targets))


def inside(directory: Path, path: Path) -> Path:
    """`path` with its symlinks resolved; ValueError unless it lies inside `directory`."""
    resolved = path.resolve()
    if not resolved.is_relative_to(directory):
        raise ValueError(f"{path} resolves outside the LoRA directory")
    return resolved


def weights_file(directory: Path, entry: Path) -> tuple[str, Path] | None:
    """An entry of `lora_dir` as (name, weights file), or None when it is no adapter."""
    if entry.is_dir() and (entry / WEIGHTS_NAME).is_file():
        return entry.name, inside(directory, entry / WEIGHTS_NAME)
    if entry.is_file() and entry.suffix == SUFFIX:
        return entry.stem, inside(directory, entry)
    return None


def find_adapter(directory: Path, name: str, given: str) -> AdapterFile:
    """The adapter at `given` (absolute, or relative to `directory`), named `name`: it must
    resolve inside the directory and be an adapter's directory or file; ValueError otherwise."""
    entry = directory / given  # an absolute `given` stays itself
    inside(directory, entry)
    found = weights_file(directory, entry)
    if found is None:
        raise ValueError(
            f"{given} is neither a directory holding {WEIGHTS_NAME} nor a {SUFFIX} file"
        )
    return inspect(name, found[1])


class LoraCatalog:
    """The adapters of `lora_dir` a request may name, checked against the stage's limits.

    With runtime updates the names change while the stage serves: `publish` and `withdraw`
    (event loop) replace the `adapters` mapping rather than change it, so the engine thread
    (`resolve`, `current`) always reads a whole one."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.adapters: dict[str, AdapterFile] = {}
        if config.directory is not None:
            self.scan(config.directory)

    def scan(self, directory: Path) -> None:
        """Every adapter of the directory whose rank fits the slots (the others are logged and
        skipped: one bad file must not keep the stage from serving the rest)."""
        for entry in sorted(directory.iterdir()):
            try:
                found = weights_file(directory, entry)
                if found is None:
                    continue
                adapter = inspect(*found)
                self.check_rank(adapter)
            except (OSError, ValueError) as exc:
                logger.warning("LoRA %s skipped: %s", entry.name, exc)
                continue
            self.adapters[adapter.name] = adapter

    def check_rank(self, adapter: AdapterFile) -> None:
        """ValueError when the adapter's rank does not fit the slots."""
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(
                f"rank {adapter.rank} > max_lora_rank {self.config.max_lora_rank}"
            )

    def publish(self, adapter: AdapterFile) -> None:
        """Requests may name `adapter` from now on (a runtime load)."""
        self.adapters = {**self.adapters, adapter.name: adapter}

    def withdraw(self, name: str) -> None:
        """Requests may no longer name `name` (a runtime unload); rows holding it keep it."""
        self.adapters = {key: value for key, value in self.adapters.items() if key != name}

    def current(self, adapter: AdapterFile) -> bool:
        """Whether a request naming `adapter.name` now gets this very file."""
        return self.adapters.get(adapter.name) == adapter

    def resolve(self, uses: Sequence[LoraUse]) -> tuple[AdapterFile, ...]:
        """The files a request's adapters name now (in prepare): a name withdrawn since the
        request was checked is InvalidInputError naming `lora`."""
        adapters, files = self.adapters, []
        for use in uses:
            adapter = adapters.get(use.name)
            if adapter is None:
                raise InvalidInputError(FIELD, f"lora: adapter {use.name!r} was unloaded")
            files.append(adapter)
        return tuple(files)

    @property
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def targets(self) -> frozenset[str]:
        """Every module some adapter of the catalog targets (those that get slot stacks)."""
        return frozenset().union(*(a.targets for a in self.adapters.values()))

    def check(self, uses: Sequence[LoraUse]) -> None:
        """A request's adapters: known names, each once, |scale| within max_lora_scale, at most
        max_loras_per_request; InvalidInputError naming `lora` otherwise."""
        config = self.config
        if uses and not config.enabled:
            raise InvalidInputError(FIELD, "lora: this stage serves no LoRA adapters")
        if len(uses) > config.max_loras_per_request:
            raise InvalidInputError(
                FIELD,
                f"lora: at most {config.max_loras_per_request} adapters per request, "
                f"got {len(uses)}",
            )
        seen: set[str] = set()
        for use in uses:
            if use.name not in self.adapters:
                raise InvalidInputError(FIELD, f"lora: unknown adapter {use.name!r}")
            if use.name in seen:
                raise InvalidInputError(FIELD, f"lora: adapter {use.name!r} named twice")
            seen.add(use.name)
            if not (math.isfinite(use.scale) and abs(use.scale) <= config.max_lora_scale):
                raise InvalidInputError(
                    FIELD,
                    f"lora: scale of {use.name!r} must be within "
                    f"±{config.max_lora_scale}, got {use.scale}",
                )
