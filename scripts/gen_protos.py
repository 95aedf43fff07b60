#!/usr/bin/env python3
"""Regenerate the committed gRPC/protobuf stubs in protocol/v1 from its .proto files.

    python scripts/gen_protos.py          # rewrite the stubs
    python scripts/gen_protos.py --check  # exit 1 if the committed stubs are stale

protoc sees the folder under its import name (``swarmgrad/protocol=protocol``), so the generated
modules import each other as ``swarmgrad.protocol.v1.x_pb2``, the way the installed package does.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protocol" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto in protocol/v1; return the generated files, in out_dir."""
    from grpc_tools import protoc  # dev dependency; imported late so --help works without it

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"--proto_path=swarmgrad/protocol={ROOT / 'protocol'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(f"swarmgrad/protocol/v1/{p.name}" for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = out_dir / "swarmgrad" / "protocol" / "v1"
    return sorted(p for p in generated.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def committed() -> list[Path]:
    return sorted(p for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def stale_files() -> list[str]:
    """Names of stubs that are missing, extra, or differ from what protoc generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        have = {p.name: p for p in committed()}
        names = sorted(fresh.keys() | have.keys())
        return [
            n
            for n in names
            if n not in fresh or n not in have or not filecmp.cmp(fresh[n], have[n], shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale stubs: {', '.join(stale)}; run: python scripts/gen_protos.py")
            return 1
        print("stubs are up to date")
        return 0
    for old in committed():
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copy(path, PROTO_DIR / path.name)
            print(f"wrote protocol/v1/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
