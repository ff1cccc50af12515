"""Refresh the README's pictures of the playground page (docs/playground-*.png).

The pictures are the browser test's own screenshots: this runs that test (it starts the default
mesh, as `make test` does) and copies the chosen screenshots from test-results/playground/ to
docs/. Run from the repository root, in the project's environment:

    python tools/playground_pictures.py
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("playground_pictures")

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "test-results" / "playground"
#: screenshot of the test -> picture in docs/
PICTURES = {"image-running": "playground-preview.png", "image-done": "playground-image.png",
            "image-cancelled": "playground-cancelled.png", "chat": "playground-chat.png",
            "talk": "playground-talk.png"}
#: The browser tests that take those screenshots.
TESTS = "generate_then_cancel or chat_answers or microphone"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in PICTURES:
        (SHOTS / f"{name}.png").unlink(missing_ok=True)  # no stale picture survives a failure
    test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/e2e/test_playground.py", "-k", TESTS], cwd=ROOT, check=False)
    if test.returncode != 0:
        log.error("the browser test failed: docs/ left as it was")
        return test.returncode
    for name, picture in PICTURES.items():
        shutil.copyfile(SHOTS / f"{name}.png", ROOT / "docs" / picture)
        log.info("docs/%s <- %s", picture, (SHOTS / f"{name}.png").relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
