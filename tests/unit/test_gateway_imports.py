"""The gateway is thin: importing every one of its modules (sub-packages included) loads no
model library, and no package of it holds more than MAX_MODULES modules.

The import probe runs in a fresh interpreter, because this test process has torch loaded
already (conftest).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import stagemesh.gateway

FORBIDDEN = ("torch", "diffusers", "transformers", "stagemesh.models")

PROBE = """
import importlib, json, pkgutil, sys
import stagemesh.gateway as gateway
names = sorted(m.name for m in pkgutil.walk_packages(gateway.__path__, "stagemesh.gateway."))
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules
                if any(m == f or m.startswith(f + ".") for f in json.loads(sys.argv[1])))
print(json.dumps({"imported": names, "forbidden_loaded": loaded}))
"""


def test_no_gateway_module_imports_torch_diffusers_transformers_or_models() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(FORBIDDEN)],
                            capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {m.name for m in pkgutil.walk_packages(stagemesh.gateway.__path__,
                                                     "stagemesh.gateway.")}
    assert set(report["imported"]) == expected and len(expected) > 10
    assert report["forbidden_loaded"] == []


#: A package of more modules than this is a folder waiting to be split (by resource, by job).
MAX_MODULES = 12


def test_no_gateway_package_holds_more_than_12_modules() -> None:
    packages = ["stagemesh.gateway", *(m.name for m in pkgutil.walk_packages(
        stagemesh.gateway.__path__, "stagemesh.gateway.") if m.ispkg)]
    sizes = {}
    for name in packages:
        package = importlib.import_module(name)
        sizes[name] = sum(not m.ispkg for m in pkgutil.iter_modules(package.__path__))
    assert len(sizes) > 5 and all(size > 0 for size in sizes.values()), sizes
    assert {name: size for name, size in sizes.items() if size > MAX_MODULES} == {}
