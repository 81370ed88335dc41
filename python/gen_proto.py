"""Regenerates the gRPC stubs under larder/v1/ from ../proto/larder/v1/larder.proto.

    .venv-oldest/bin/python python/gen_proto.py [OUTPUT_DIR]

The stubs are committed so the package installs without grpcio-tools; a test checks that they
match the proto. They are generated with grpcio-tools 1.49.1 (protoc 3.21), whose code runs on
every protobuf from 4.21 to 7.x and every grpcio we support; code from newer generators refuses
older protobuf runtimes and older grpcio. scripts/setup installs it in .venv-oldest.
"""

import pathlib
import sys
from importlib.metadata import version

# The generator the committed stubs come from.
GENERATOR = "1.49.1"
HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent / "proto"


def generator_here() -> bool:
    try:
        return version("grpcio-tools") == GENERATOR
    except Exception:
        return False


def generate(out: pathlib.Path) -> None:
    if not generator_here():
        raise SystemExit(f"generate the stubs with grpcio-tools=={GENERATOR} (.venv-oldest/bin/python)")
    from grpc_tools import protoc

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
