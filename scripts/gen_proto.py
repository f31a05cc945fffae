"""Regenerate the committed Python stubs in service/proto_gen/ from proto/moespec/v1/*.proto, and
the descriptor set server reflection serves.

Run from anywhere: `python scripts/gen_proto.py` (needs grpcio-tools). The outputs are committed so
a plain `pip install .` needs no code generation; rerun this after editing a .proto and commit the
result. protoc writes absolute imports (`from moespec.v1 import ...`); they are rewritten to the
package the stubs live in. The runtime protobuf must be at least the gencode version printed.

The descriptor set (service/proto_gen/descriptors.binpb, package data) holds every file under
proto/ compiled with their source info (--include_source_info): the .proto comments, which is
where the API contract is written, reach reflection clients only that way (the Python stubs'
descriptors carry no comments). proto/grpc/ (the reflection v1 interface) goes into the set only:
no Python stubs, so nothing of ours is registered under gRPC's own file and symbol names.
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
DESCRIPTOR_SET = OUT / "descriptors.binpb"  # read by service.server.reflection
STUB_ROOTS = ("moespec",)  # proto/ folders that get Python stubs; the rest goes into the set only


def main() -> int:
    every = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    protos = [p for p in every if p.split("/", 1)[0] in STUB_ROOTS]
    OUT.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_python_out={OUT}"]
    if protoc.main(args + protos) != 0:
        return 1
    descriptor_args = ["protoc", f"-I{PROTO_ROOT}", "--include_source_info", "--include_imports",
                       f"--descriptor_set_out={DESCRIPTOR_SET}"]
    if protoc.main(descriptor_args + every) != 0:
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
        print(f"generated {len(protos)} proto(s) and a descriptor set of {len(every)}; "
              f"gencode protobuf {'.'.join(gencode.groups())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
