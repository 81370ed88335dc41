"""Regenerates the gRPC stubs under larder/v1/ from ../proto/larder/v1/larder.proto.

    python python/gen_proto.py [OUTPUT_DIR]

The stubs are committed so the package installs without grpcio-tools; a test checks that they
match the proto.
"""

import pathlib
import sys

from grpc_tools import protoc

HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent / "proto"


def generate(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        "larder/v1/larder.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
