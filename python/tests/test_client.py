"""The numpy/torch client against a real larderd over gRPC."""

import os
import signal
import threading

import numpy as np
import pytest
import larder
from conftest import SHAPE, buffer_span, data_span, needs_torch, ring_span, sample, torch, within

LENGTH = int(np.prod(SHAPE))


def check_batches(batches, n=300):
    ids = []
    for b in batches:
        assert b.images.dtype == np.uint8
        assert b.images.shape == (b.size,) + SHAPE
        for k, i in enumerate(b.sample_ids):
            np.testing.assert_array_equal(b.images[k].reshape(-1), sample(int(i), LENGTH))
            assert b.labels[k] == i % 10
        ids.extend(int(i) for i in b.sample_ids)
    assert sorted(ids) == list(range(n)), "every sample exactly once"
    return ids


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_lists_datasets_and_streams_an_epoch(daemon, transport):
    with larder.Client(getattr(daemon, transport)) as c:
        (info,) = c.datasets()
        assert (info.name, info.num_samples, list(info.sample_shape)) == ("train", 300, list(SHAPE))
        batches = list(c.stream("train", 32, seed=7, epoch=1))
        assert [b.index for b in batches] == list(range(10))
        order = check_batches(batches)
        assert order != list(range(300)), "shuffled"
        assert order == [int(i) for b in c.stream("train", 32, seed=7, epoch=1) for i in b.sample_ids]
        stats = c.stats()
        assert stats.samples_served == 600
        assert {t.tier for t in stats.tiers} == {"memory", "scratch", "raw"}


@pytest.fixture
def received(monkeypatch):
    """{batch index: the bytes of its message as grpc handed them to the client}, for every
    StreamBatches message of every Client made in the test."""
    from larder import client, wire

    messages = {}

    class Recorded(wire.RawBatch):
        def __init__(self, raw):
            super().__init__(raw)
            messages[self.msg.batch_index] = raw

    monkeypatch.setattr(client, "RawBatch", Recorded)
    return messages


@pytest.mark.parametrize("transport", ["shm", "bytes"])
def test_batches_are_views_not_copies(daemon, transport, received):
    with larder.Client(daemon.unix) as c:
        stream = c.stream("train", 16, transport=transport)
        b = next(stream)
        stream.close()  # the ring (if any) goes back to the client; the batch keeps its slot
        if transport == "shm":
            # Every field's elements lie in the slot of the ring that holds the batch, in the
            # memory this process maps the daemon's memfd at: nothing was copied out of it.
            (ring,) = c._idle_rings
            (slot,) = ring.held
            start = ring_span(ring)[0] + slot * ring.slot_bytes
            where = (start, start + ring.slot_bytes)
        else:
            # Every field's elements lie in the bytes of the message grpc received.
            where = buffer_span(received[b.index])
        for name in ("image", "label"):
            assert within(b[name], where), f"{name} is a copy, not in the {transport} batch's memory"
        np.testing.assert_array_equal(b.images[0].reshape(-1), sample(int(b.sample_ids[0]), LENGTH))
        # In shared memory the arrays are the slot's (writable); in a message, its bytes.
        assert b.images.flags.writeable == (transport == "shm")


@needs_torch
@pytest.mark.parametrize("transport", ["shm", "bytes"])
def test_torch_tensors_share_the_batch_memory(daemon, transport):
    import larder.torch

    with larder.Client(daemon.unix) as c:
        b = next(c.stream("train", 16, transport=transport))
        images, labels = b.torch()
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert images.data_ptr() == b.images.ctypes.data, "torch shares the numpy memory"
        assert images.shape == (16,) + SHAPE
        x = larder.torch.to_float(images, "cpu", mean=[0.5, 0.5], std=[0.25, 0.25])
        assert x.dtype == torch.float32
        expected = (images.float() / 255 - 0.5) / 0.25
        assert torch.allclose(x, expected)


def test_ranks_and_resume(daemon):
    with larder.Client(daemon.unix) as c:
        shards = [list(c.stream("train", 10, seed=3, rank=r, world_size=3)) for r in range(3)]
        ids = [int(i) for s in shards for b in s for i in b.sample_ids]
        assert sorted(ids) == list(range(300))
        full = list(c.stream("train", 10, seed=3))
        rest = list(c.stream("train", 10, seed=3, start_batch=4))
        assert [b.index for b in rest] == list(range(4, 30))
        for a, b in zip(full[4:], rest):
            np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
            np.testing.assert_array_equal(a.images, b.images)


def test_bad_requests_raise_clear_errors(daemon):
    with larder.Client(daemon.unix) as c:
        with pytest.raises(larder.LarderError, match='unknown dataset "nope"; `larder datasets` lists those you may read'):
            list(c.stream("nope", 10))
        with pytest.raises(larder.LarderError, match="rank 5 is out of range") as e:
            list(c.stream("train", 10, rank=5, world_size=2))
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert len(list(c.stream("train", 100))) == 3, "and the daemon keeps serving"
    with larder.Client("unix:/nonexistent.sock", reconnect_timeout=0.3) as c:
        with pytest.raises(larder.LarderError, match=r"no larder daemon at unix:/nonexistent.sock: is larderd running\?"):
            list(c.stream("train", 10))
        # A rank of a job over several nodes is told which node has no daemon, and why it needs one.
        import socket

        with pytest.raises(larder.LarderError, match=rf"node 1 of 2 \({socket.gethostname()}\): a job over several "
                                                     "nodes needs a larderd on every node"):
            list(c.stream("train", 10, rank=1, world_size=2, nodes=2, node=1))


@pytest.fixture
def plan_calls(monkeypatch):
    """The PlanStream requests of every Client made in the test, as they were sent."""
    from larder.v1 import larder_pb2_grpc as pb_grpc

    calls = []

    class CountingStub(pb_grpc.LarderStub):
        def __init__(self, channel):
            super().__init__(channel)
            plan = self.PlanStream

            def counted(request, *args, **kwargs):
                calls.append(type(request).FromString(request.SerializeToString()))
                return plan(request, *args, **kwargs)

            self.PlanStream = counted

    monkeypatch.setattr(pb_grpc, "LarderStub", CountingStub)
    return calls


@pytest.mark.parametrize("address,transport", [("unix", "shm"), ("unix", "bytes"), ("tcp", "auto")])
def test_one_plan_per_stream(daemon, plan_calls, address, transport):
    with larder.Client(getattr(daemon, address)) as c:
        for epoch in range(2):
            stream = c.stream("train", 32, seed=4, epoch=epoch, transport=transport)
            first = next(stream)
            assert first.images.flags.writeable == (transport == "shm"), "in the ring, or in the message"
            del first
            assert len(list(stream)) == 9
            assert len(plan_calls) == epoch + 1, "one PlanStream per stream"
            assert (plan_calls[-1].dataset, plan_calls[-1].epoch, plan_calls[-1].seed) == ("train", epoch, 4)
        assert c.plan("train", 32).num_batches == 10 and len(plan_calls) == 3, "Client.plan asks"


@needs_torch
def test_one_plan_per_dataset_iteration(daemon, plan_calls):
    from larder.torch import LarderIterableDataset

    ds = LarderIterableDataset("train", 32, address=daemon.unix)
    for epoch in range(2):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
        assert sum(1 for _ in loader) == 10
        assert [r.epoch for r in plan_calls] == list(range(epoch + 1)), "one PlanStream per epoch's stream"
    # len() asks for the whole epoch once (in this process now that it has a connection).
    assert len(ds) == len(ds) == 10 and len(plan_calls) == 3


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_streams_resume_after_a_daemon_restart(daemon, sig, plan_calls):
    with larder.Client(daemon.unix, reconnect_timeout=30) as c:
        stream = c.stream("train", 10, seed=11, epoch=2)
        got = [next(stream) for _ in range(3)]
        daemon.stop(sig)
        restarted = threading.Timer(0.5, daemon.start)
        restarted.start()
        got.extend(stream)
        restarted.join()
    assert [b.index for b in got] == list(range(30))
    check_batches(got)
    # The stream keeps its plan across the restart (and makes its new ring with its slot size).
    assert len(plan_calls) == 1


def test_warm_reports_progress(daemon):
    with larder.Client(daemon.tcp) as c:
        progress = list(c.warm("train"))
        assert progress[-1].done == progress[-1].total == 300
        assert progress[-1].written + progress[-1].present == 300
        with pytest.raises(larder.LarderError, match="unknown dataset"):
            list(c.warm("nope"))


def test_batches_parsed_without_copying_their_data_match_protobuf():
    from larder.client import Batch
    from larder.v1 import larder_pb2 as pb
    from larder.wire import RawBatch

    msg = pb.Batch(batch_index=3, num_batches=9, sample_ids=[5, 300, 70000])
    msg.fields.add(name="image", dtype="uint8", shape=[3, 2], sample_shape=[2], data=bytes(range(6)))
    msg.fields.add(name="empty", dtype="int16", shape=[3, 0], sample_shape=[-1], lengths=[0, 0, 0])
    msg.fields.add(name="label", dtype="int64", shape=[3], data=np.arange(3, dtype=np.int64).tobytes())
    raw = msg.SerializeToString()
    fast, plain = Batch(RawBatch(raw)), Batch(pb.Batch.FromString(raw))
    assert (fast.index, fast.num_batches, list(fast.sample_ids)) == (3, 9, [5, 300, 70000])
    for name in ("image", "empty", "label"):
        np.testing.assert_array_equal(fast[name], plain[name])
        assert fast[name].dtype == plain[name].dtype and fast[name].shape == plain[name].shape
    # Views of the message: each field's elements are the very bytes of its data in `raw`.
    first = buffer_span(raw)[0]
    for name, data in [("image", bytes(range(6))), ("label", np.arange(3, dtype=np.int64).tobytes())]:
        at = raw.find(data)
        assert at > 0 and raw.find(data, at + 1) < 0
        assert data_span(fast[name]) == (first + at, first + at + len(data)), f"{name} is a copy"


def test_wire_field_numbers_are_the_descriptors_and_spans_are_right():
    from larder import wire
    from larder.v1 import larder_pb2 as pb

    assert wire.BATCH_FIELDS == pb.Batch.DESCRIPTOR.fields_by_name["fields"].number
    assert wire.FIELD_DATA == pb.FieldBatch.DESCRIPTOR.fields_by_name["data"].number
    image, label = bytes(range(200, 248)), np.arange(4, dtype=np.int64).tobytes()
    msg = pb.Batch(batch_index=1, num_batches=2, sample_ids=[0, 1, 2, 3], resume_sample=8)
    msg.fields.add(name="image", dtype="uint8", shape=[4, 12], sample_shape=[12], data=image)
    msg.fields.add(name="label", dtype="int64", shape=[4], data=label)
    raw = msg.SerializeToString()
    parsed = wire.RawBatch(raw)
    assert parsed.raw is raw
    assert [raw[a:b] for a, b in parsed.spans] == [image, label]
    assert [f.data for f in parsed.msg.fields] == [b"", b""], "protobuf copied none of the data"
    expected = pb.Batch()
    expected.CopyFrom(msg)
    for f in expected.fields:
        f.data = b""
    assert parsed.msg == expected, "everything else as protobuf parses it"


def test_a_user_adds_streams_and_removes_a_dataset_of_their_own(daemon, tmp_path):
    import grpc
    import pwd
    import time

    from conftest import make_h5

    make_h5(tmp_path / "mine.h5", 50)
    me = pwd.getpwuid(os.getuid()).pw_name
    name = f"{me}/mine"
    with larder.Client(daemon.unix) as c:
        # The daemon names the kind: the client passes none.
        assert c.source_kind(tmp_path / "mine.h5") == "hdf5"
        info = c.add_dataset("mine", tmp_path / "mine.h5", labels="labels")
        assert (info.name, info.num_samples, info.owner, info.kind) == (name, 50, me, "hdf5")
        assert sorted(int(i) for b in c.stream(name, 16) for i in b.sample_ids) == list(range(50))
        with pytest.raises(larder.LarderError) as e:
            c.add_dataset("mine", tmp_path / "mine.h5", labels="labels")
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(larder.LarderError) as e:
            c.add_dataset("other", tmp_path / "missing.h5")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "missing.h5" in str(e.value)
        assert "other" not in str([d.name for d in c.datasets()]), "nothing kept of a failed add"
    with larder.Client(daemon.tcp) as c, pytest.raises(larder.LarderError) as e:
        c.add_dataset("tcp", tmp_path / "mine.h5")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    # Kept across a restart, then removed.
    daemon.stop()
    daemon.start()
    with larder.Client(daemon.unix) as c:
        deadline = time.monotonic() + 20
        while name not in [d.name for d in c.datasets()]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sum(b.size for b in c.stream(name, 16)) == 50
        c.remove_dataset(name)
        assert name not in [d.name for d in c.datasets()]
        with pytest.raises(larder.LarderError) as e:
            c.remove_dataset(name)
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_the_daemon_names_a_paths_kind(daemon, tmp_path):
    """`Client.source_kind` asks the daemon what a path is read as; `add_dataset` without a
    `kind` is the kind the daemon recognises; a path no kind recognises is refused with the
    daemon's reason."""
    from PIL import Image

    from conftest import make_h5

    make_h5(tmp_path / "arrays.h5", 20)
    for i in range(4):
        (tmp_path / "pics" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), (i * 40, 0, 0)).save(tmp_path / "pics" / f"c{i % 2}" / f"{i}.png")
    (tmp_path / "notes.txt").write_text("no kind of source\n")
    with larder.Client(daemon.unix) as c:
        assert c.source_kind(tmp_path / "arrays.h5") == "hdf5"
        assert c.source_kind(str(tmp_path / "pics")) == "images"
        for path in (tmp_path / "notes.txt", tmp_path / "missing"):
            with pytest.raises(larder.LarderError) as e:
                c.source_kind(path)
            assert str(e.value) and path.name in str(e.value), str(e.value)
        info = c.add_dataset("kinded-pics", tmp_path / "pics", resize=8, crop=8)
        assert (info.kind, info.num_samples) == ("images", 4)
        assert {d.name: d.kind for d in c.datasets()}[info.name] == "images"
        c.remove_dataset(info.name)


def test_an_unavailable_the_daemon_says_is_shown_as_it_said_it(tmp_path):
    """UNAVAILABLE from the daemon itself (here a gRPC server that answers GetInfo and refuses
    ListDatasets as a daemon does for a dataset being opened) is the daemon's message, not
    'no larder daemon ... is larderd running?'."""
    from concurrent import futures

    import grpc

    from larder import version
    from larder.v1 import larder_pb2 as pb
    from larder.v1 import larder_pb2_grpc as pbg

    class Answering(pbg.LarderServicer):
        def GetInfo(self, request, context):
            return pb.DaemonInfo(version="0.1.0", api_version=version.API_VERSION,
                                 min_client_api_version=version.API_VERSION)

        def ListDatasets(self, request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, 'dataset "x" is not served now: it is being opened')

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pbg.add_LarderServicer_to_server(Answering(), server)
    sock = tmp_path / "s.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        with larder.Client(f"unix:{sock}") as c:
            with pytest.raises(larder.LarderError, match="is being opened") as e:
                c.datasets()
            assert "is larderd running" not in str(e.value)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
