"""The built wheel holds every runtime module, and each one imports from it.

The wheel is built offline from a copy of the files git would commit (as in a fresh clone),
installed without dependencies into a folder, and imported there by a Python that sees only that
folder and this environment's site-packages (not the editable install), so a module missing from
the wheel fails the import instead of being found in the working tree.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

#: Imports every module of the installed `stagemesh` (but __main__, which runs the CLI), checks
#: each came from the install folder, and prints their names.
IMPORT_EVERY_MODULE = """
import importlib, pathlib, pkgutil, sys
install = pathlib.Path(sys.argv[1]).resolve()
import stagemesh
names = ["stagemesh", *(m.name for m in pkgutil.walk_packages(stagemesh.__path__, "stagemesh."))]
for name in names:
    if name != "stagemesh.__main__":
        module = importlib.import_module(name)
        assert install in pathlib.Path(module.__file__).resolve().parents, (name, module.__file__)
assert "matplotlib" not in sys.modules, "a runtime module imports matplotlib (the bench extra)"
print("\\n".join(names))
"""


#: Serves `/`, every asset the page names and every module those import or load (an
#: AudioWorklet's), from the installed package (never the working tree), and prints their paths.
SERVE_THE_PLAYGROUND = """
import pathlib, re, sys
from starlette.applications import Starlette
from starlette.testclient import TestClient
from stagemesh.gateway.playground import routes as playground
install = pathlib.Path(sys.argv[1]).resolve()
assert install in pathlib.Path(playground.__file__).resolve().parents, playground.__file__
client = TestClient(Starlette(routes=playground.playground_routes()))
page = client.get("/")
assert page.status_code == 200 and page.headers["content-security-policy"] == playground.CSP
todo = re.findall(r'(?:src|href)="(/playground/static/[^"]+)"', page.text)
seen = set()
while todo:  # the page's assets, then every module they import, transitively
    path = todo.pop()
    if path not in seen:
        seen.add(path)
        asset = client.get(path)
        assert asset.status_code == 200, path
        imported = re.findall(r'from "\\./([^"]+)"', asset.text)
        todo += [f"/playground/static/{name}" for name in imported]
        todo += re.findall(r'"(/playground/static/[^"]+)"', asset.text)  # a worklet's module
print("\\n".join(sorted(seen)))
"""


def _committed_files() -> list[str]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know which files a clone holds")
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, check=True, capture_output=True).stdout
    return [name for name in listing.decode().split("\0") if (REPO_ROOT / name).is_file()]


def _runtime_modules(files: list[str]) -> set[str]:
    """Wheel paths of the .py files that sit in a package: every folder up to the root (the
    `stagemesh` package) has an __init__.py. setup.py is the build script, not a module."""
    present = set(files)
    modules = set()
    for name in files:
        path = Path(name)
        folders = [parent for parent in path.parents if parent != Path(".")]
        if (path.suffix == ".py" and name != "setup.py"
                and all(str(folder / "__init__.py") in present for folder in folders)):
            modules.add(f"stagemesh/{name}")
    return modules


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """(the wheel, the files of the clone it was built from)."""
    work = tmp_path_factory.mktemp("wheel")
    files = _committed_files()
    for name in files:
        (work / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, work / "src" / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--wheel-dir", str(work / "dist"), str(work / "src")],
                   check=True, timeout=300)
    (wheel,) = (work / "dist").glob("stagemesh-*.whl")
    return wheel, files


def test_the_wheel_holds_exactly_the_runtime_modules_and_their_data(
        built: tuple[Path, list[str]]) -> None:
    wheel, files = built
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n for n in names if n.endswith(".py")} == _runtime_modules(files)
    model = Path("assets/tiny-shapes")  # its JSON files and every file of its subfolders
    shipped_assets = {f"stagemesh/{n}" for n in files if Path(n).parent.parent == model
                      or (Path(n).parent == model and n.endswith(".json"))}
    stubs = {f"stagemesh/{n}" for n in files if n.startswith("shared/proto/v1/")
             and n.endswith(".pyi")}
    assert shipped_assets and stubs
    assert shipped_assets | stubs <= names
    assert {"stagemesh/py.typed", "stagemesh/gateway/recipes/default.yaml"} <= names
    page = {f"stagemesh/{n}" for n in files if n.startswith("gateway/playground/static/")}
    assert "stagemesh/gateway/playground/static/index.html" in page and page <= names


def test_bench_and_training_dependencies_are_extras(built: tuple[Path, list[str]]) -> None:
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    requires = metadata.get_all("Requires-Dist") or []
    assert [r for r in requires if r.startswith("matplotlib")] == [
        'matplotlib==3.11.2; extra == "bench"']
    assert [r for r in requires if r.startswith("tqdm")] == ['tqdm==4.70.1; extra == "train"']
    assert {"bench", "train", "dev"} <= set(metadata.get_all("Provides-Extra") or [])


@pytest.fixture(scope="module")
def installed(built: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, dict[str, str]]:
    """(the folder the wheel is installed into, the environment that imports only from it)."""
    wheel, _ = built
    install = tmp_path_factory.mktemp("installed") / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--target", str(install), str(wheel)], check=True, timeout=120)
    # -S: no site-packages and so no .pth files (the editable install is one); the environment's
    # packages come only through PYTHONPATH, after the install folder.
    paths = dict.fromkeys([str(install), sysconfig.get_path("purelib"),
                           sysconfig.get_path("platlib")])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    return install, env


def test_every_module_imports_from_the_installed_wheel(
        built: tuple[Path, list[str]], installed: tuple[Path, dict[str, str]],
        tmp_path: Path) -> None:
    _, files = built
    install, env = installed
    imported = subprocess.run([sys.executable, "-S", "-c", IMPORT_EVERY_MODULE, str(install)],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr
    expected = {path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                for path in _runtime_modules(files)}
    assert set(imported.stdout.split()) == expected

    cli = subprocess.run([sys.executable, "-S", "-m", "stagemesh", "--help"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "{serve,gateway,stage,model,bench,train,eval}" in cli.stdout


def test_the_installed_wheel_serves_the_playground(installed: tuple[Path, dict[str, str]],
                                                   tmp_path: Path) -> None:
    install, env = installed
    served = subprocess.run([sys.executable, "-S", "-c", SERVE_THE_PLAYGROUND, str(install)],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert served.returncode == 0, served.stderr
    assert {"/playground/static/app.js", "/playground/static/audio.js",
            "/playground/static/style.css", "/playground/static/mic-worklet.js"} <= set(
        served.stdout.split())
