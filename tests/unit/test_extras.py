"""The `bench`, `train` and `voice-gpl` extras stay optional: no module imports them when it is
imported.

Read from the source (module-level import statements, including those under a top-level `if` or
`try`, but not under `if TYPE_CHECKING:`): tqdm is installed anyway as a dependency of
transformers, so importing every module could not tell our import of it from theirs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import stagemesh

#: Extra -> the modules it provides.
EXTRAS = {"bench": ("matplotlib", "simpy"), "train": ("tqdm",),
          # GPL-3.0-or-later: the phonemizer of the Piper voice stays an optional extra.
          "voice-gpl": ("piper",),
          # PyAV: its wheel's FFmpeg links libx264 (GPL-2.0-or-later): the MP4 muxer's extra.
          "video-gpl": ("av",)}
ROOT = Path(stagemesh.__file__).parent


def _runtime_sources() -> list[Path]:
    """Every module of the `stagemesh` package: .py files in folders that are packages, down
    from the root (tests/, tools/ and the rest have no __init__.py); setup.py is the build."""
    sources, packages = [], [ROOT]
    while packages:
        package = packages.pop()
        sources += [path for path in package.glob("*.py") if path != ROOT / "setup.py"]
        packages += [child for child in package.iterdir()
                     if child.is_dir() and (child / "__init__.py").is_file()]
    return sources


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_time_imports(tree: ast.Module) -> Iterator[str]:
    """Top-level module names imported when the module is, not inside functions or classes."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0]
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending += node.orelse  # the body runs only under a type checker
        elif isinstance(node, ast.If | ast.Try | ast.With):
            pending += [child for child in ast.iter_child_nodes(node)
                        if isinstance(child, ast.stmt)]
            if isinstance(node, ast.Try):
                pending += [stmt for handler in node.handlers for stmt in handler.body]


def test_no_runtime_module_imports_an_extra_at_import_time() -> None:
    sources = _runtime_sources()
    assert ROOT / "bench" / "common.py" in sources and ROOT / "cli.py" in sources
    offending = []
    for path in sources:
        imported = set(_import_time_imports(ast.parse(path.read_text(), str(path))))
        offending += [f"{path.relative_to(ROOT)} imports {module} ([{extra}] extra)"
                      for extra, modules in EXTRAS.items() for module in modules
                      if module in imported]
    assert offending == []


def test_the_check_sees_imports_under_if_and_try_but_not_in_functions_or_for_types() -> None:
    tree = ast.parse("import a.b\nif x:\n    from c import d\ntry:\n    import e\n"
                     "except ImportError:\n    import f\ndef g():\n    import h\n"
                     "if TYPE_CHECKING:\n    import i\nelse:\n    import j\n")
    assert sorted(_import_time_imports(tree)) == ["a", "c", "e", "f", "j"]
