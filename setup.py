"""Packaging glue that pyproject.toml cannot express; everything declarative lives there.

The repository root *is* the `stagemesh` package (package-dir {"stagemesh": "."}), so the design
card's folders (gateway/, services/, shared/ ...) import as stagemesh.gateway etc. Two things
follow that setuptools cannot do from configuration alone:

1. The package list: every package folder under the root, prefixed with `stagemesh.`, is found
   here instead of kept by hand (a folder missing from a hand-kept list silently left the wheel).
2. The editable install (`pip install -e .`): setuptools' default for a renamed root is an import
   hook, which type checkers cannot follow, and its `editable_mode=strict` links file by file,
   so a new module needs a reinstall. Here an editable install is one static `.pth` line naming
   a folder that holds a single symlink, `stagemesh -> <repository root>`: mypy and pyright read
   static `.pth` paths, and new modules appear without a reinstall. Where symlinks cannot be
   made, setuptools' own strategy is used.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Protocol

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
# Folders under the root that hold no runtime code. find_packages only walks folders with an
# __init__.py (and skips dotted names such as .venv); these stay out even if one gains one.
NOT_SHIPPED = ("tests", "tools", "third_party", "docs", "k8s", "protos", "assets", "build",
               "node_modules")
# Where an editable install keeps its one symlink (build/ is ignored by git, docker and ruff).
EDITABLE_DIR = Path("build", "__editable__")


def runtime_packages() -> list[str]:
    """`stagemesh` plus every package folder below the root, as `stagemesh.<dotted path>`."""
    excluded = [pattern for name in NOT_SHIPPED for pattern in (name, f"{name}.*")]
    found = find_packages(where=str(ROOT), exclude=excluded)
    return ["stagemesh", *(f"stagemesh.{package}" for package in sorted(found))]


class BuildPy(build_py):
    """build_py without this script, which sits in the `stagemesh` package folder (the root)."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [module for module in modules if module[:2] != ("stagemesh", "setup")]


class _Wheel(Protocol):
    def writestr(self, name: str, data: str) -> None: ...


class _SymlinkedRoot:
    """Editable strategy: a `.pth` naming `link_dir`, whose `stagemesh` links to `root`."""

    def __init__(self, name: str, root: Path, link_dir: Path) -> None:
        self.name = name
        self.root = root
        self.link_dir = link_dir

    def __call__(self, wheel: _Wheel, files: list[str], mapping: dict[str, str]) -> None:
        # Made beside and renamed over the old link, so `stagemesh` never goes missing for a
        # process importing it during a reinstall.
        fresh = self.link_dir / ".stagemesh.new"
        if fresh.is_symlink():
            fresh.unlink()
        fresh.symlink_to(self.root, target_is_directory=True)
        os.replace(fresh, self.link_dir / "stagemesh")
        wheel.writestr(f"__editable__.{self.name}.pth", f"{self.link_dir.resolve()}\n")

    def __enter__(self) -> _SymlinkedRoot:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        return None


class EditableWheel(editable_wheel):
    """`pip install -e .` as a static path (see the module docstring)."""

    def _select_strategy(self, name: str, tag: str, build_lib: str) -> object:
        root = Path(self.project_dir).resolve()
        link_dir = root / EDITABLE_DIR
        if not _can_symlink(link_dir, root):
            return super()._select_strategy(name, tag, build_lib)
        return _SymlinkedRoot(name, root, link_dir)


def _can_symlink(folder: Path, target: Path) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / ".symlink-probe"
    try:
        if probe.is_symlink():
            probe.unlink()
        os.symlink(target, probe, target_is_directory=True)
    except OSError:
        return False
    probe.unlink()
    return True


setup(packages=runtime_packages(), cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
