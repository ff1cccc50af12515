"""The gateway is thin: importing every one of its modules loads no model library.

Run in a fresh interpreter, because this test process has torch loaded already (conftest).
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import stagemesh.gateway

FORBIDDEN = ("torch", "diffusers", "transformers", "stagemesh.models")

PROBE = """
import importlib, json, pkgutil, sys
import stagemesh.gateway as gateway
names = sorted(f"stagemesh.gateway.{m.name}" for m in pkgutil.iter_modules(gateway.__path__))
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
    expected = {f"stagemesh.gateway.{m.name}"
                for m in pkgutil.iter_modules(stagemesh.gateway.__path__)}
    assert set(report["imported"]) == expected and len(expected) > 10
    assert report["forbidden_loaded"] == []
