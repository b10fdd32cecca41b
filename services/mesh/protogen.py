"""Generates the Python code for the mesh's protos, or checks that the committed code is current.

Usage: python -m services.mesh.protogen [--check] PROTO_ROOT
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(proto_root: Path, out_dir: Path) -> None:
    sources = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    status = protoc.main(["grpc_tools.protoc", f"-I{proto_root}", f"-I{include}",
                          f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                          f"--grpc_python_out={out_dir}", *sources])
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")


def generated_files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")
            if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("proto_root", type=Path)
    args = parser.parse_args(argv)
    if not args.check:
        generate(args.proto_root, args.proto_root)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(args.proto_root, fresh_root)
        fresh, committed = generated_files(fresh_root), generated_files(args.proto_root)
        stale = sorted(str(p) for p in fresh ^ committed)
        stale += sorted(str(p) for p in fresh & committed
                        if not filecmp.cmp(fresh_root / p, args.proto_root / p, shallow=False))
        shutil.rmtree(fresh_root, ignore_errors=True)
    if stale:
        print("generated proto code is stale; run `make protos`:", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
