"""Chat recipes: a `chat` task served by a thinker, and the speech recipe that speaks it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.gateway.recipes import Recipe, RecipeError, Task, load_recipes

SPEECH = """
  - name: voice
    task: text-to-speech
    model: m
    stages: {talker: {address: "127.0.0.1:1"}, codec: {address: "127.0.0.1:2"}}
"""


def chat(speech: str = "") -> str:
    return f"""
  - name: talkative
    task: chat
    model: m
    stages: {{thinker: {{address: "127.0.0.1:3"}}}}
    {speech}
"""


def load(tmp_path: Path, body: str) -> dict[str, Recipe]:
    path = tmp_path / "recipes.yaml"
    path.write_text("recipes:" + body)
    return load_recipes(path)


def test_the_default_mesh_chats_through_its_default_voice() -> None:
    recipes = load_recipes()
    chats = [r for r in recipes.values() if r.task is Task.CHAT]
    assert [(r.name, tuple(r.stages)) for r in chats] == [("smollm2", ("thinker",))]
    assert recipes[chats[0].speech].task is Task.TEXT_TO_SPEECH


@pytest.mark.parametrize(("body", "match"), [
    (chat("speech: nowhere") + SPEECH, "'nowhere' is not a text-to-speech recipe"),
    (chat("speech: talkative"), "'talkative' is not a text-to-speech recipe"),
    (chat("speech: 3") + SPEECH, "speech recipe name, got 3"),
    (SPEECH.replace("model: m", "model: m\n    speech: voice"), "a chat recipe's speech"),
    (chat().replace("thinker", "talker"), r"task chat needs stages \['thinker'\]"),
])
def test_a_bad_speech_recipe_fails_naming_it(tmp_path: Path, body: str, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        load(tmp_path, body)


LISTENER = """
  - name: ears
    task: speech-to-text
    model: w
    stages:
      transcriber: {address: "127.0.0.1:1"}
"""


def test_the_default_mesh_chats_hearing_through_its_listener() -> None:
    recipes = load_recipes()
    assert recipes[recipes["smollm2"].listen].task is Task.SPEECH_TO_TEXT
    assert tuple(recipes["smollm2"].stages) == ("thinker",)


@pytest.mark.parametrize(("body", "match"), [
    (chat("listen: ears") + SPEECH + LISTENER, None),
    (chat("listen: talkative") + LISTENER, "'talkative' is not a speech-to-text recipe"),
    (chat("listen: voice") + SPEECH, "'voice' is not a speech-to-text recipe"),
    (LISTENER.replace("model: w", "model: w\n    listen: ears"), "a chat recipe's listen"),
])
def test_a_chat_recipe_names_its_listener(tmp_path: Path, body: str, match: str | None) -> None:
    if match is None:
        assert load(tmp_path, body)["talkative"].listen == "ears"
        return
    with pytest.raises(RecipeError, match=match):
        load(tmp_path, body)


def test_a_chat_recipe_may_leave_its_voice_to_the_default(tmp_path: Path) -> None:
    # No `speech:`: the gateway speaks through the first text-to-speech recipe.
    assert load(tmp_path, chat() + SPEECH)["talkative"].speech == ""
