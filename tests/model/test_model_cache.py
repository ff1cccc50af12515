"""Where built models go: the user's cache directory, never the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagemesh.models import speech
from stagemesh.models.cache import cache_root, models_dir


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A clean environment: HOME in tmp_path, no cache variables set."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("STAGEMESH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path / "home"


def test_default_is_the_users_cache(home: Path) -> None:
    assert cache_root() == home / ".cache" / "stagemesh"
    assert models_dir() == home / ".cache" / "stagemesh" / "models"


def test_xdg_cache_home_comes_next(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/someone")
    assert cache_root() == Path("/var/cache/someone/stagemesh")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says: ignore it
    assert cache_root() == home / ".cache" / "stagemesh"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache_root() == home / ".cache" / "stagemesh"


def test_stagemesh_cache_wins(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/someone")
    monkeypatch.setenv("STAGEMESH_CACHE", "/srv/models-cache")
    assert cache_root() == Path("/srv/models-cache")
    monkeypatch.setenv("STAGEMESH_CACHE", "~/elsewhere")
    assert cache_root() == home / "elsewhere"


def test_the_speech_builder_uses_the_cache(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fake_build(out_dir: str | Path, seed: int = 0) -> Path:
        stamp = {"version": speech.BUILD_VERSION}
        (Path(out_dir) / speech.BUILD_STAMP_FILE).write_text(json.dumps(stamp))
        return Path(out_dir)

    monkeypatch.setattr(speech, "build_tiny_csm", fake_build)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert speech.ensure_speech_model() == tmp_path / "xdg" / "stagemesh" / "models" / "csm-tiny"
