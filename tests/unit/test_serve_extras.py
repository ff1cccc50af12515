"""`stagemesh serve` leaves out the recipes whose optional extras are not installed (one warning
per extra, naming the install command), with the chat recipes that speak through them, unless
--strict makes that fatal; `model prepare --json` reports the extras a family's stages need,
and the registry those of a built-in model before it is built."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.models.families import CONFIG_FILE, PIPER_FAMILY
from stagemesh.serve import MissingExtra
from stagemesh.serve.extras import servable_recipes
from stagemesh.serve.models import builtin_extras
from stagemesh.shared.extras import VOICE_GPL, Extra

#: An extra whose module is installed nowhere, and one whose module is always there.
ABSENT = Extra("voice-gpl", "stagemesh_no_such_module", "a phonemizer")
PRESENT = Extra("present", "json", "the json module")


def _recipe(name: str, task: Task, model: str, *stages: str, speech: str = "") -> Recipe:
    endpoints = {stage: StageEndpoint(stage, f"127.0.0.1:{50100 + i}")
                 for i, stage in enumerate(stages)}
    return Recipe(name=name, task=task, model=model, stages=endpoints, speech=speech)


RECIPES = {
    "image": _recipe("image", Task.TEXT_TO_IMAGE, "img", "tokenizer", "dit", "vae"),
    "chat": _recipe("chat", Task.CHAT, "llm", "thinker", speech="voice"),
    "voice": _recipe("voice", Task.TEXT_TO_SPEECH, "piper", "talker", "codec"),
    "other-voice": _recipe("other-voice", Task.TEXT_TO_SPEECH, "csm", "talker", "codec"),
}


def _prepared(talker_extra: Extra) -> dict[str, dict[str, Extra]]:
    """Model spec -> stage -> extra, as the prepared models report them."""
    return {"img": {}, "llm": {}, "piper": {"talker": talker_extra}, "csm": {}}


def test_a_recipe_lacking_its_extra_is_skipped_with_the_chat_that_speaks_through_it(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        served = servable_recipes(RECIPES, _prepared(ABSENT))
    assert list(served) == ["image", "other-voice"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "pip install 'stagemesh[voice-gpl]'" in warnings[0]
    assert "voice (its talker stage)" in warnings[0]
    assert "chat (it speaks through voice)" in warnings[0]


def test_every_recipe_is_served_when_its_extras_are_installed(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert servable_recipes(RECIPES, _prepared(PRESENT), strict=True) == RECIPES
    assert not caplog.records


def test_strict_makes_a_missing_extra_fatal_and_names_it() -> None:
    with pytest.raises(MissingExtra, match=r"pip install 'stagemesh\[voice-gpl\]'"):
        servable_recipes(RECIPES, _prepared(ABSENT), strict=True)


def test_nothing_left_to_serve_is_an_error() -> None:
    only_voice = {"voice": RECIPES["voice"]}
    with pytest.raises(MissingExtra, match="no recipe left to serve"):
        servable_recipes(only_voice, _prepared(ABSENT))


def test_an_extra_hidden_by_an_import_hook_counts_as_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Hide:
        def find_spec(self, name: str, *args: object) -> None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(sys, "meta_path", [Hide(), *sys.meta_path])
    assert not Extra("voice-gpl", "stagemesh_hidden_module", "hidden").installed()
    assert PRESENT.installed()  # already imported: found in sys.modules


def test_model_prepare_json_names_the_extra_each_stage_of_the_family_needs(
        tmp_path: Path) -> None:
    piper, plain = tmp_path / "piper", tmp_path / "plain"
    piper.mkdir()
    plain.mkdir()
    (piper / CONFIG_FILE).write_text(json.dumps({"family": PIPER_FAMILY}))
    done = subprocess.run([sys.executable, "-m", "stagemesh", "model", "prepare", "--json",
                           str(piper), str(plain)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert [json.loads(line) for line in done.stdout.splitlines()] == [
        {"folder": str(piper), "extras": {"talker": VOICE_GPL.name}},
        {"folder": str(plain), "extras": {}}]


def test_the_registry_knows_a_built_in_models_extras_before_building_it() -> None:
    assert builtin_extras(["builtin:piper-joe", "builtin:tiny-shapes", "/a/piper/folder"]) == {
        "builtin:piper-joe": {"talker": VOICE_GPL}, "builtin:tiny-shapes": {},
        "/a/piper/folder": {}}
