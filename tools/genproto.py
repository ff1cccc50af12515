"""Generate the Python stubs in shared/proto/v1 from protos/stagemesh/v1 (one command).

    python tools/genproto.py           # regenerate
    python tools/genproto.py --check   # fail if the checked-in stubs drift from the protos

protoc names Python modules after proto paths (`stagemesh/v1/x.proto` -> `stagemesh.v1.x_pb2`),
which would put a generic `stagemesh.v1` next to our package. We generate into a scratch folder
and rewrite those imports to relative ones, so the stubs live at `stagemesh.shared.proto.v1`.
"""

from __future__ import annotations

import argparse
import filecmp
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "stagemesh" / "v1"
OUT_DIR = ROOT / "shared" / "proto" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")

log = logging.getLogger("genproto")


def generate(into: Path) -> None:
    """Run protoc (with mypy-protobuf for typed .pyi) over every proto into `into`."""
    scratch = into / "scratch"
    scratch.mkdir()
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{ROOT / 'third_party'}",
        f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
        f"--python_out={scratch}",
        f"--mypy_out={scratch}",
        f"--grpc_python_out={scratch}",
        f"--mypy_grpc_out={scratch}",
        *protos,
    ]
    # mypy-protobuf's plugins sit next to this interpreter, maybe outside PATH.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in (scratch / "stagemesh" / "v1").iterdir():
        if path.name.endswith(GENERATED_SUFFIXES):
            text = re.sub(r"^from stagemesh\.v1 import", "from . import", path.read_text(),
                          flags=re.MULTILINE)
            text = re.sub(r"^import stagemesh\.v1\.(\w+)", r"from . import \1", text,
                          flags=re.MULTILINE)
            if path.suffix == ".pyi":  # .py files embed descriptors: never touch those bytes
                text = text.replace("stagemesh.v1.", "")
            (into / path.name).write_text(text)
    shutil.rmtree(scratch)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when stubs are out of date")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        names = sorted(p.name for p in fresh.iterdir())
        current = sorted(p.name for p in OUT_DIR.glob("*_pb2*"))
        if check:
            _, mismatch, errors = filecmp.cmpfiles(fresh, OUT_DIR, names, shallow=False)
            stale = sorted(set(mismatch) | set(errors) | (set(current) - set(names)))
            if stale:
                log.error("generated stubs drift from protos/: %s\nrun: python tools/genproto.py",
                          ", ".join(stale))
                return 1
            log.info("stubs match protos (%d files)", len(names))
            return 0
        for name in current:
            (OUT_DIR / name).unlink()
        for name in names:
            shutil.copy(fresh / name, OUT_DIR / name)
        log.info("wrote %d files to %s", len(names), OUT_DIR.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
