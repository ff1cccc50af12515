"""The README's quick start as data: the code blocks of its "Quick start" section and the
marker before each (`<!-- quickstart: NAME -->`). tests/e2e/test_readme_quickstart.py runs the
marked blocks; tests/unit/test_docs.py checks that no block of the section goes unmarked."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

_SECTION = re.compile(r"^## Quick start\n(.*?)(?=^## |\Z)", re.MULTILINE | re.DOTALL)
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!-- quickstart: ([a-z][a-z-]*) -->")


@dataclass(frozen=True)
class Block:
    """One fenced code block of the quick start."""

    name: str | None  # the marker's NAME; None when the block has no marker right before it
    language: str  # the fence's info string: bash, python, ...
    code: str


def quickstart_blocks(readme: str | None = None) -> list[Block]:
    """Every fenced block of the README's "Quick start" section, in order (empty if the README
    has no such section)."""
    text = README.read_text() if readme is None else readme
    section = _SECTION.search(text)
    if section is None:
        return []
    body = section.group(1)
    blocks = []
    for fence in _FENCE.finditer(body):
        before = body[:fence.start()].splitlines()
        marker = _MARKER.fullmatch(before[-1]) if before else None  # the line right above
        blocks.append(Block(marker.group(1) if marker else None, fence.group(1), fence.group(2)))
    return blocks
