"""Where stagemesh keeps the models it builds: the user's cache directory, never the package.

`cache_root()` is `$STAGEMESH_CACHE` when set, else `$XDG_CACHE_HOME/stagemesh` (an absolute
XDG_CACHE_HOME only, as the XDG base-directory spec says), else `~/.cache/stagemesh`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

#: Overrides every other choice (tests, containers, a shared volume).
CACHE_ENV = "STAGEMESH_CACHE"
APP_DIR = "stagemesh"


def cache_root() -> Path:
    """The folder under which every built model lives (it need not exist yet)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / APP_DIR


def models_dir(root: Path | None = None) -> Path:
    """The folder that holds one subfolder per built model."""
    return (root if root is not None else cache_root()) / "models"


def build_into_cache(name: str, build: Callable[[Path], object],
                     is_current: Callable[[Path], bool], root: Path | None = None) -> Path:
    """The cached folder `name`, built by `build(folder)` unless `is_current(folder)`.

    The build goes to a temporary folder next to the target and is renamed into place, so a
    concurrent reader never sees a half-written model; a stale build is replaced the same way.
    """
    target = models_dir(root) / name
    if is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=target.parent))
            target.rename(stale / name)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(target)
    except OSError:
        # Another process renamed its build into place first; theirs is as good as ours.
        if not is_current(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
