"""Regenerate the committed Python stubs in service/proto_gen/ from proto/moespec/v1/*.proto.

Run from anywhere: `python scripts/gen_proto.py` (needs grpcio-tools). The stubs are committed so
a plain `pip install .` needs no code generation; rerun this after editing a .proto and commit the
result. protoc writes absolute imports (`from moespec.v1 import ...`); they are rewritten to the
package the stubs live in. The runtime protobuf must be at least the gencode version printed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "service" / "proto_gen"
PACKAGE = "service.proto_gen"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    OUT.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_python_out={OUT}"]
    if protoc.main(args + protos) != 0:
        return 1
    for py in OUT.rglob("*.py*"):
        if py.suffix not in (".py", ".pyi"):
            continue
        text = py.read_text()
        fixed = re.sub(r"^from moespec\.", f"from {PACKAGE}.moespec.", text, flags=re.M)
        if fixed != text:
            py.write_text(fixed)
    # Every directory on the import path needs an __init__.py for setuptools' package discovery.
    for d in [OUT, *[p for p in OUT.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
        (d / "__init__.py").touch()
    pattern = r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)"
    gencode = re.search(pattern, (OUT / "moespec" / "v1" / "moespec_pb2.py").read_text())
    if gencode:
        print(f"generated {len(protos)} proto(s); gencode protobuf {'.'.join(gencode.groups())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
