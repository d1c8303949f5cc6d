"""Generate the Python gRPC code of proto/ into minipaged/v1/ (or --out DIR, for the staleness test).

Run by `make proto`; the generated files are committed so a reader sees them, and
tests/test_proto.py fails when they differ from what proto/ generates."""
from __future__ import annotations

import argparse
import glob
import os
import sys

from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(out: str) -> list[str]:
    import grpc_tools

    protos = sorted(glob.glob(os.path.join(ROOT, "proto", "minipaged", "v1", "*.proto")))
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{os.path.join(ROOT, 'proto')}", f"-I{include}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg = os.path.join(out, "minipaged", "v1")
    init = os.path.join(pkg, "__init__.py")
    with open(init, "w") as f:
        f.write('"""Generated from proto/minipaged/v1 by scripts/gen_proto.py. Do not edit."""\n')
    return sorted(glob.glob(os.path.join(pkg, "*.py*")))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=ROOT)
    files = generate(ap.parse_args().out)
    print(f"generated {len(files)} files", file=sys.stderr)
