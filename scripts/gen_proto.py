#!/usr/bin/env python3
"""Regenerate tensorcast/proto/*_pb2*.py from tensorcast.proto.

`--check` fails when the checked-in files are stale.
"""

from __future__ import annotations

import argparse
import difflib
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "tensorcast" / "proto"
GENERATED = ("tensorcast_pb2.py", "tensorcast_pb2.pyi", "tensorcast_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "tensorcast.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        produced = Path(tmp) / "tensorcast" / "proto"
        stale = []
        for name in GENERATED:
            target = PROTO_DIR / name
            if check:
                if not target.exists() or not filecmp.cmp(produced / name, target, shallow=False):
                    stale.append(name)
                    old = target.read_text().splitlines() if target.exists() else []
                    diff = difflib.unified_diff(old, (produced / name).read_text().splitlines())
                    sys.stderr.write("\n".join(list(diff)[:40]) + "\n")
            else:
                shutil.copyfile(produced / name, target)
    if stale:
        print(f"stale generated files: {stale}; run scripts/gen_proto.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
