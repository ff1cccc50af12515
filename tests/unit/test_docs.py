"""The README and docs/ keep their promises to a reader: a short README that starts with the two
commands CI runs, a quick start whose every block is marked (so tests/e2e/
test_readme_quickstart.py runs it), no paragraph telling the history of a change, links that
lead somewhere, and benchmark JSON that names the commit it was measured on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.readme_quickstart import README, quickstart_blocks

ROOT = README.parent
DOCS = ROOT / "docs"
MAX_README_LINES = 400
#: Words that tell the story of a change rather than what is (history goes to docs/bench/).
NARRATION = re.compile(r"\b(now|this session|session \d+|was fixed|used to|no longer|"
                       r"previously|before,|not yet)\b", re.IGNORECASE)
_FENCED = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)|<img src=\"([^\"]+)\"")
_HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)


def prose(markdown: str) -> str:
    """The text outside fenced code blocks."""
    return _FENCED.sub("", markdown)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces -> -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    counts: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(prose(markdown)):
        base = slug(heading)
        found.add(f"{base}-{counts[base]}" if base in counts else base)
        counts[base] = counts.get(base, 0) + 1
    return found


def documents() -> Iterator[Path]:
    yield README
    yield from sorted(DOCS.rglob("*.md"))


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_second() -> None:
    first = re.search(r"^```(\w*)\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL)
    assert first is not None and first.group(1) == "bash"
    commands = [line.split("#")[0].strip() for line in first.group(2).splitlines()]
    assert commands == ["make serve", "make test"]
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"], "CI must run exactly the README's test command"
    targets = re.findall(r"^(\w[\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert {"serve", "test"} <= set(targets)


def test_every_quick_start_block_is_marked_once() -> None:
    blocks = quickstart_blocks()
    assert blocks, "the README has a quick start with code"
    names = [block.name for block in blocks]
    assert None not in names, "a quick start block without its <!-- quickstart: NAME --> marker"
    assert len(set(names)) == len(names)


def test_a_block_without_a_marker_is_seen() -> None:
    readme = "## Quick start\n\n<!-- quickstart: a -->\n```bash\ntrue\n```\n\n```bash\nfalse\n```\n"
    assert [(b.name, b.code) for b in quickstart_blocks(readme)] == [("a", "true\n"),
                                                                      (None, "false\n")]


def test_no_readme_paragraph_narrates_a_change() -> None:
    found = NARRATION.findall(prose(README.read_text()))
    assert not found, f"history belongs in docs/bench/history.md or the commit log: {found}"


@pytest.mark.parametrize("document", list(documents()), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_and_heading_that_exist(document: Path) -> None:
    broken = []
    for target in (a or b for a, b in _LINK.findall(prose(document.read_text()))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        missing_heading = (anchor and resolved.suffix == ".md" and resolved.exists()
                           and anchor not in anchors(resolved.read_text()))
        if not resolved.exists() or missing_heading:
            broken.append(target)
    assert not broken, broken


def test_slugs_follow_github() -> None:
    assert slug("Measuring: `stagemesh bench accel --suite quant`") == \
        "measuring-stagemesh-bench-accel---suite-quant"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def sources(document: Any) -> Iterator[Any]:
    """Every `source` record anywhere in a benchmark JSON."""
    if isinstance(document, dict):
        for key, value in document.items():
            if key == "source":
                yield value
            yield from sources(value)
    elif isinstance(document, list):
        for value in document:
            yield from sources(value)


def provenance_problems(document: Any) -> list[str]:
    """Why a benchmark JSON does not say it measured one committed version of the code."""
    found = list(sources(document))
    if not found:
        return ["no source record (bench/common.py machine_info)"]
    return [f"not a clean commit: {source}" for source in found
            if not (isinstance(source, dict) and source.get("dirty") is False
                    and re.fullmatch(r"[0-9a-f]{40}", str(source.get("commit", ""))))]


def test_a_benchmark_json_must_name_one_clean_commit() -> None:
    commit = {"commit": "a" * 40, "dirty": False}
    assert provenance_problems({"machine": {"source": commit}}) == []
    assert provenance_problems({"machine_before": {"source": commit}, "rows": [1]}) == []
    assert provenance_problems({"machine": {"load_average": [1, 1, 1]}}) != []
    assert provenance_problems({"machine": {"source": {**commit, "dirty": True}}}) != []
    assert provenance_problems({"machine": {"source": {"version": "0.1.0"}}}) != []


@pytest.mark.parametrize("path", sorted((DOCS / "bench").glob("*.json")), ids=lambda p: p.name)
def test_every_published_benchmark_names_its_commit(path: Path) -> None:
    assert provenance_problems(json.loads(path.read_text())) == [], path.name


def test_every_benchmark_in_the_readme_is_in_docs_benchmarks() -> None:
    readme = README.read_text()
    table = readme[readme.index("## Benchmarks"):]
    commands = re.findall(r"^\| `(stagemesh [^`]+)`", table, re.MULTILINE)
    assert commands
    benchmarks = (DOCS / "benchmarks.md").read_text()
    assert [c for c in commands if c not in benchmarks] == []
