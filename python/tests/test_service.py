"""What the daemon offers clients that are not larder's own: the standard gRPC health service
(grpc.health.v1, as Kubernetes probes and grpc_health_probe ask it) and server reflection (as
grpcurl asks it); and what larder's own client says when its API and the daemon's differ."""

import json
import pathlib
import shutil
import signal
import subprocess
import warnings

import grpc
import pytest

import larder
from conftest import Daemon, h5_table, make_h5


def health(target: str, service: str):
    """The health service's answer for `service`: its status's name, or the error's code."""
    h = pytest.importorskip("grpc_health.v1.health_pb2")
    hg = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
    # As a client is written from the docs: no channel options, on the Unix socket too.
    with grpc.insecure_channel(target.removeprefix("http://")) as ch:
        try:
            answer = hg.HealthStub(ch).Check(h.HealthCheckRequest(service=service), timeout=10)
        except grpc.RpcError as e:
            return e.code().name
        return h.HealthCheckResponse.ServingStatus.Name(answer.status)


def test_health_answers_for_the_daemon_and_for_each_dataset_a_caller_may_see(tmp_path):
    pytest.importorskip("grpc_health")
    make_h5(tmp_path / "a.h5", 20)
    tables = h5_table("public", tmp_path / "a.h5") + f'[[dataset]]\nname = "broken"\npath = "{tmp_path / "gone.h5"}"\n'
    d = Daemon(tmp_path, tables)
    try:
        with larder.Client(d.unix) as c:
            c.add_dataset("mine", tmp_path / "a.h5", labels="labels")
            mine = [x.name for x in c.datasets() if x.name.endswith("/mine")][0]
        for target in (d.unix, d.tcp):
            assert health(target, "") == "SERVING"
            assert health(target, "larder.v1.Larder") == "SERVING"
            assert health(target, "public") == "SERVING"
            assert health(target, "no-such") == "NOT_FOUND"
        # A dataset added over the Unix socket is not for TCP callers, who have no identity:
        # they are told nothing of it, as of a name that does not exist.
        assert health(d.unix, mine) == "SERVING"
        assert health(d.tcp, mine) == "NOT_FOUND"
        # The config's dataset that does not open: NOT_SERVING to the admin (root, here), who
        # sees it listed as unavailable; TCP callers are told nothing of it.
        assert health(d.unix, "broken") == "NOT_SERVING"
        assert health(d.tcp, "broken") == "NOT_FOUND"

        # Watch: SERVING now, then NOT_SERVING when the daemon starts draining, then the end.
        h = pytest.importorskip("grpc_health.v1.health_pb2")
        hg = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
        with grpc.insecure_channel(d.tcp.removeprefix("http://")) as ch:
            watch = hg.HealthStub(ch).Watch(h.HealthCheckRequest(service=""), timeout=30)
            assert next(watch).status == h.HealthCheckResponse.SERVING
            d.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == h.HealthCheckResponse.NOT_SERVING
            with pytest.raises(StopIteration):
                next(watch)
        d.proc.wait(timeout=20)
    finally:
        d.stop()


def test_a_client_generated_from_the_proto_talks_to_the_unix_socket_as_written(tmp_path):
    """grpcio sends the socket's path (percent-encoded) as the request's authority on a Unix
    socket; the daemon serves such a client with no channel options: a call, a stream, health
    and reflection."""
    from larder.v1 import larder_pb2 as pb
    from larder.v1 import larder_pb2_grpc as pbg

    make_h5(tmp_path / "a.h5", 20)
    d = Daemon(tmp_path, h5_table("a", tmp_path / "a.h5"))
    try:
        with grpc.insecure_channel(d.unix) as ch:
            stub = pbg.LarderStub(ch)
            names = [x.name for x in stub.ListDatasets(pb.ListDatasetsRequest(), timeout=10).datasets]
            assert names == ["a"], names
            ids = [i for b in stub.StreamBatches(pb.StreamBatchesRequest(dataset="a", batch_size=6, seed=1),
                                                 timeout=30)
                   for i in b.sample_ids]
            assert sorted(ids) == list(range(20)), ids
            try:  # grpcio-reflection and grpcio-health-checking: in .venv, not in .venv-oldest
                from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
                    ProtoReflectionDescriptorDatabase)
            except ImportError:
                return
            assert "larder.v1.Larder" in set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert health(d.unix, "") == "SERVING"
    finally:
        d.stop()


GRPC_JS = pathlib.Path(__file__).parent / "grpcjs"


@pytest.mark.skipif(not (GRPC_JS / "node_modules").is_dir() or shutil.which("node") is None,
                    reason="no Node or no grpc-js (scripts/setup installs them)")
def test_a_javascript_client_written_from_the_proto_streams_over_the_unix_socket(tmp_path):
    """grpc-js with the proto loaded at run time, no channel options (grpcjs/client.js): the
    datasets listed, and an epoch with every sample exactly once."""
    make_h5(tmp_path / "a.h5", 20)
    d = Daemon(tmp_path, h5_table("a", tmp_path / "a.h5"))
    try:
        out = subprocess.run(["node", str(GRPC_JS / "client.js"), d.unix, "a", "6"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["datasets"] == ["a"]
        assert sorted(got["ids"]) == list(range(20)), got["ids"]
    finally:
        d.stop()


def test_reflection_lists_the_services_and_describes_larder(tmp_path):
    pytest.importorskip("grpc_reflection")
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    make_h5(tmp_path / "a.h5", 4)
    d = Daemon(tmp_path, h5_table("a", tmp_path / "a.h5"))
    try:
        with grpc.insecure_channel(d.tcp.removeprefix("http://")) as ch:
            db = ProtoReflectionDescriptorDatabase(ch)
            services = set(db.get_services())
            assert {"larder.v1.Larder", "grpc.health.v1.Health"} <= services, services
            larder_service = DescriptorPool(db).FindServiceByName("larder.v1.Larder")
            methods = {m.name for m in larder_service.methods}
            assert {"StreamBatches", "ListDatasets", "GetInfo"} <= methods, methods
    finally:
        d.stop()


def test_the_client_says_which_side_to_upgrade(tmp_path, monkeypatch):
    make_h5(tmp_path / "a.h5", 4)
    d = Daemon(tmp_path, h5_table("a", tmp_path / "a.h5"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same API: not a word
            with larder.Client(d.unix) as c:
                info = c.info()
                assert info.api_version == larder.version.API_VERSION and info.version == larder.__version__
                assert "lmdb" in info.kinds and "hdf5" in info.kinds
                assert [x.name for x in c.datasets()] == ["a"]
        # A client newer than the daemon: it works, and is told to upgrade the daemon.
        monkeypatch.setattr(larder.version, "API_VERSION", larder.version.API_VERSION + 1)
        with larder.Client(d.unix) as c:
            with pytest.warns(larder.version.LarderVersionWarning, match="older than this larder-client.*Upgrade larderd"):
                assert [x.name for x in c.datasets()] == ["a"]
        # A client older than the daemon serves: refused, told to upgrade the client.
        monkeypatch.setattr(larder.version, "API_VERSION", 0)
        with larder.Client(d.unix) as c:
            with pytest.raises(larder.LarderError, match=r"upgrade the client \(pip install -U /usr/share/larder/larder_client-"):
                c.datasets()
    finally:
        d.stop()
