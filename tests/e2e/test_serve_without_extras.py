"""`stagemesh serve` without the voice-gpl extra: nothing extra is installed or removed; an
import hook in every serve process (a sitecustomize on PYTHONPATH) hides the phonemizer module
`piper`. serve leaves out the Piper voice and the chat recipe that speaks through it, with one
warning naming the extra, and serves the rest; `--strict` refuses to start instead."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from stagemesh.gateway.recipes import DEFAULT_RECIPES
from stagemesh.shared.extras import VOICE_GPL

from .conftest import Served, start_serve, stop_serve

pytestmark = pytest.mark.timeout(600)

#: Every process that imports site (serve, its launcher, its stages) cannot import `piper`.
HIDE_PIPER = f"""
import sys

class _HideExtra:
    def find_spec(self, name, path=None, target=None):
        if name == {VOICE_GPL.module!r} or name.startswith({VOICE_GPL.module + "."!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden)", name=name)
        return None

sys.meta_path.insert(0, _HideExtra())
"""
#: From the default mesh: an image recipe, the Piper voice, and the chat that speaks with it.
KEPT = ("tiny-shapes", "piper-joe", "smollm2")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A recipe file of KEPT, and serve's environment with `piper` hidden."""
    root = tmp_path_factory.mktemp("no-voice-extra")
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HIDE_PIPER)
    document = yaml.safe_load(Path(DEFAULT_RECIPES).read_text())
    document["recipes"] = [r for r in document["recipes"] if r["name"] in KEPT]
    assert [r["name"] for r in document["recipes"]] == list(KEPT)
    for recipe in document["recipes"]:  # its listener (no extra needed) is not kept here
        recipe.pop("listen", None)
    recipes = root / "recipes.yaml"
    recipes.write_text(yaml.safe_dump(document))
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    return recipes, {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1"}


def test_the_hook_hides_the_extra(setup: tuple[Path, dict[str, str]]) -> None:
    _, env = setup
    probe = subprocess.run([sys.executable, "-c", f"import {VOICE_GPL.module}"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "hidden" in probe.stderr


def test_strict_refuses_to_start_and_names_the_extra(setup: tuple[Path, dict[str, str]],
                                                     tmp_path: Path) -> None:
    recipes, env = setup
    log = tmp_path / "stderr"
    with pytest.raises(RuntimeError, match=r"stagemesh serve exited with [1-9]"):
        start_serve("--recipes", str(recipes), "--strict", env=env, stderr=log)
    assert VOICE_GPL.install_hint in log.read_text().splitlines()[-1]


@pytest.fixture(scope="module")
def served_without_voice(setup: tuple[Path, dict[str, str]],
                         tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[tuple[Served, Path]]:
    recipes, env = setup
    log = tmp_path_factory.mktemp("serve") / "stderr"
    served = start_serve("--recipes", str(recipes), env=env, stderr=log)
    yield served, log
    assert stop_serve(served) == 0, "Ctrl-C must shut the mesh down cleanly"


def test_serve_comes_up_with_the_other_recipes(
        served_without_voice: tuple[Served, Path]) -> None:
    mesh, _ = served_without_voice
    models = httpx.get(f"{mesh.http_url}/v1/models", timeout=10).json()
    assert [model["id"] for model in models["data"]] == ["tiny-shapes"]
    health = httpx.get(f"{mesh.http_url}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert not any(name in str(health["stages"]) for name in ("talker", "codec", "thinker"))
    listed = httpx.get(f"{mesh.http_url}/v1/stages", timeout=10).json()["stages"]
    assert {row["recipe"] for row in listed} == {"tiny-shapes"}


def test_one_warning_names_the_extra_and_every_skipped_recipe(
        served_without_voice: tuple[Served, Path]) -> None:
    _, log = served_without_voice
    warnings = [line for line in log.read_text().splitlines() if VOICE_GPL.install_hint in line]
    assert len(warnings) == 1
    assert "piper-joe (its talker stage)" in warnings[0]
    assert "smollm2 (it speaks through piper-joe)" in warnings[0]
