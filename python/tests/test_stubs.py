"""The committed gRPC stubs are the ones proto/larder/v1/larder.proto generates."""

import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = HERE.parent / "larder" / "v1"


def test_stubs_match_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", HERE.parent / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    if not gen.generator_here():
        pytest.skip(f"checked where grpcio-tools=={gen.GENERATOR} is (.venv-oldest)")
    gen.generate(tmp_path)
    for name in ["larder_pb2.py", "larder_pb2.pyi", "larder_pb2_grpc.py"]:
        fresh = (tmp_path / "larder" / "v1" / name).read_text()
        assert fresh == (PACKAGE / name).read_text(), (
            f"larder/v1/{name} is out of date: run `python python/gen_proto.py`"
        )
