"""Where stagemesh keeps the models it builds: the user's cache directory, never the package.

`cache_root()` is `$STAGEMESH_CACHE` when set, else `$XDG_CACHE_HOME/stagemesh` (an absolute
XDG_CACHE_HOME only, as the XDG base-directory spec says), else `~/.cache/stagemesh`.
"""

from __future__ import annotations

import os
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
