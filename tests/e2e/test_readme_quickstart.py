"""The README's quick start, run as written against the default mesh, and what it made judged.

Each block marked `<!-- quickstart: NAME -->` in the README's "Quick start" section runs in a
fresh folder — bash blocks with bash, Python blocks with this interpreter — with the two
variables the README tells a user to set to point the examples at a mesh (`OPENAI_BASE_URL`,
`OPENAI_API_KEY`), against the shared default mesh (`served`, tests/e2e/conftest.py). Then the
files and output it made are judged as a user would: the image is the asked scene (the
tiny-shapes scorer), the edit did what it was asked, the speech is heard (Whisper tiny.en, the
intelligibility judge), the video has its frames, the cancel stopped the DiT mid-run.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from PIL import Image

from stagemesh.models.tiny_shapes.data import parse_caption
from stagemesh.models.tiny_shapes.scoring import measure, score
from tests.readme_quickstart import Block, quickstart_blocks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: What the README's image and edit blocks ask for (checked to be in the block, so a README edit
#: that changes the scene changes this test too).
IMAGE_PROMPT = "a red circle on the left"
EDIT_INSTRUCTION, EDIT_COLOUR = "make it blue", "blue"
SPEECH_TEXT = "Hello there, how are you today?"
VIDEO_FRAMES, VIDEO_SIZE = 9, (32, 32)
#: The WAV header of a streamed answer (its length fields say "unknown").
WAV_HEADER = 44
#: The most words Whisper tiny.en may mishear in the README's sentence (1 of 6).
MAX_WER = 0.2
BLOCK_TIMEOUT_S = 180


def run(block: Block, served: Any, folder: Path) -> str:
    """Run one README block in `folder` as a user would, pointed at `served`; its stdout."""
    env = {**os.environ, "OPENAI_BASE_URL": f"{served.http_url}/v1", "OPENAI_API_KEY": "none",
           # `python3` in a bash block is this interpreter (numpy-free stdlib use only).
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = (["bash", "-euo", "pipefail", "-c", block.code] if block.language == "bash"
               else [sys.executable, "-c", block.code])
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"README block {block.name!r} failed:\n{done.stderr}"
    return done.stdout


def rgb(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def streamed_wav(path: Path) -> tuple[np.ndarray, int]:
    """Float samples and rate of a streamed WAV (length fields unknown, so read by hand)."""
    data = path.read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", "a streamed WAV starts with its header"
    rate = int.from_bytes(data[24:28], "little")
    return np.frombuffer(data[WAV_HEADER:], dtype="<i2").astype(np.float32) / 32768, rate


@pytest.fixture(scope="module")
def hear() -> Callable[[np.ndarray, int], str]:
    pytest.importorskip("faster_whisper")
    from stagemesh.models.intelligibility import Transcriber

    return Transcriber()


def check_image(block: Block, folder: Path, stdout: str, hear: Any) -> None:
    assert IMAGE_PROMPT in block.code
    seen = score(rgb(folder / "out.png"), IMAGE_PROMPT)
    assert all(seen.values()), (IMAGE_PROMPT, measure(rgb(folder / "out.png")))


def check_edit(block: Block, folder: Path, stdout: str, hear: Any) -> None:
    assert IMAGE_PROMPT in block.code and EDIT_INSTRUCTION in block.code
    edited = measure(rgb(folder / "edited.png"))
    assert edited.colour == EDIT_COLOUR, edited
    assert edited.background == parse_caption(IMAGE_PROMPT).background, edited


def check_speech(block: Block, folder: Path, stdout: str, hear: Any) -> None:
    from stagemesh.models.intelligibility import word_error_rate

    assert SPEECH_TEXT in block.code
    one_shot, rate = soundfile.read(io.BytesIO((folder / "hello.wav").read_bytes()),
                                    dtype="float32")
    for pcm, pcm_rate in ((one_shot, rate), streamed_wav(folder / "streamed.wav")):
        heard = hear(np.asarray(pcm, dtype=np.float32), pcm_rate)
        assert word_error_rate([SPEECH_TEXT], [heard]) <= MAX_WER, heard


def check_chat(block: Block, folder: Path, stdout: str, hear: Any) -> None:
    from stagemesh.models.intelligibility import normalise

    assert "Paris" in stdout, stdout
    pcm, rate = soundfile.read(io.BytesIO((folder / "answer.wav").read_bytes()), dtype="float32")
    heard = hear(np.asarray(pcm, dtype=np.float32), rate)
    # Whisper tiny.en hears this voice's "France is" as "Francis" (tests/e2e/test_serve_chat.py),
    # so the words that must be heard are these two.
    assert {"capital", "paris"} <= set(normalise(heard).split()), heard


def check_video(block: Block, folder: Path, stdout: str, hear: Any) -> None:
    pytest.importorskip("av", reason="MP4s need the video-gpl extra")
    from tests.video_forms import frames_of

    frames = frames_of((folder / "circle.mp4").read_bytes())
    assert len(frames) == VIDEO_FRAMES
    assert all(frame.shape == (*VIDEO_SIZE, 3) for frame in frames)


def check_cancel(block: Block, folder: Path, stdout: str, hear: Any) -> None:
    stage, step, latency = stdout.split()
    assert stage == "dit", stdout
    assert 5 <= int(step) < 200, "stopped mid-run, at or after the step that asked"
    assert 0 <= float(latency) < 5, stdout


#: NAME -> how to judge what that block made; every marked block has one, and only those.
CHECKS: dict[str, Callable[[Block, Path, str, Any], None]] = {
    "image": check_image, "edit": check_edit, "speech": check_speech, "chat": check_chat,
    "video": check_video, "cancel": check_cancel,
}
#: The blocks that need an optional extra, and the module that tells it is installed.
EXTRAS = {"speech": "piper", "chat": "piper", "video": "av"}
NEEDS_HEARING = ("speech", "chat")


def test_the_quick_start_is_exactly_the_checked_blocks() -> None:
    assert sorted(block.name or "" for block in quickstart_blocks()) == sorted(CHECKS)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_a_quick_start_block_runs_and_makes_what_it_says(
    served: Any, tmp_path: Path, request: pytest.FixtureRequest, name: str,
) -> None:
    if name in EXTRAS:
        pytest.importorskip(EXTRAS[name], reason=f"the {name} example needs its extra")
    block = next(b for b in quickstart_blocks() if b.name == name)
    stdout = run(block, served, tmp_path)
    hear = request.getfixturevalue("hear") if name in NEEDS_HEARING else None
    CHECKS[name](block, tmp_path, stdout, hear)
