"""Shared-memory delivery against a real larderd on a real Unix socket."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import larder
from conftest import SHAPE, Daemon, make_h5, ring_maps, ring_span, sample, within
from larder.v1 import larder_pb2 as pb

LENGTH = int(np.prod(SHAPE))
REPO = pathlib.Path(__file__).resolve().parents[2]


def check(batches, expected_ids):
    ids = []
    for b in batches:
        for k, i in enumerate(b.sample_ids):
            np.testing.assert_array_equal(b.images[k].reshape(-1), sample(int(i), LENGTH))
            assert b.labels[k] == i % 10
        ids.extend(int(i) for i in b.sample_ids)
    assert sorted(ids) == sorted(expected_ids), "every sample exactly once"


def consume(stream):
    """Reads a stream as a training loop does, each batch dropped before the next, checking
    every sample's bytes; returns the sample ids in the order served."""
    ids = []
    for b in stream:
        for k, i in enumerate(b.sample_ids):
            np.testing.assert_array_equal(b.images[k].reshape(-1), sample(int(i), LENGTH))
        ids.extend(int(i) for i in b.sample_ids)
    return ids


def rss_shmem_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    return 0


def memfd_descriptors(pid: int) -> list:
    """The open descriptors of process `pid` that are memfds ("/memfd:NAME (deleted)")."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("/memfd:"):
            out.append(target)
    return out


def test_concurrent_clients_and_ranks_get_every_sample_once_byte_exact(daemon):
    results = {}

    def job(name, rank, world):
        with larder.Client(daemon.unix) as c:
            results[name] = consume(
                c.stream("train", 16, seed=5, epoch=1, rank=rank, world_size=world, transport="shm")
            )

    threads = [threading.Thread(target=job, args=(f"solo{k}", 0, 1)) for k in range(2)]
    threads += [threading.Thread(target=job, args=(f"rank{r}", r, 3)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        assert sorted(results[f"solo{k}"]) == list(range(300))
    assert results["solo0"] == results["solo1"], "same seed and epoch, same order"
    ranks = [results[f"rank{r}"] for r in range(3)]
    assert sorted(i for r in ranks for i in r) == list(range(300))
    with larder.Client(daemon.unix) as c:
        s = c.stats()
    assert s.shm_batches > 0 and s.shm_fallbacks == 0, (s.shm_batches, s.shm_fallbacks)
    assert s.shm_rings == 0 and s.shm_bytes == 0, "every client closed: every ring freed"


def test_a_client_keeping_batches_gets_the_rest_in_messages_and_no_slot_is_reused(daemon):
    with larder.Client(daemon.unix) as c:
        kept = list(c.stream("train", 10, seed=2, transport="shm", prefetch=1))
        check(kept, range(300))  # slots were never overwritten while their batches lived
        s = c.stats()
        assert s.shm_fallbacks > 0, "30 batches kept, fewer slots: the rest came in messages"
        assert s.shm_rings == 1, "one ring, reused by the client's streams"
        del kept
        before = c.stats()
        ids = consume(c.stream("train", 10, seed=2, epoch=1))
        assert sorted(ids) == list(range(300)), "every sample exactly once"
        after = c.stats()
        assert after.shm_fallbacks == before.shm_fallbacks, "batches dropped free their slots"
        assert after.shm_rings == 1


def test_breaking_off_a_stream_frees_its_slots_for_the_next(daemon):
    with larder.Client(daemon.unix) as c:
        ring, first = None, None
        for k in range(3):
            s = c.stream("train", 10, seed=4, transport="shm")
            held = next(s)  # the batch before, from the stream before, is dropped only now
            s.close()  # broken off with batches in flight
            # The stream gave its ring back to the client: the same ring every time, in which
            # only the slot of the batch still alive is held (the ones read ahead were freed).
            (r,) = c._idle_rings
            assert ring is None or r is ring, f"break-off {k}: a new ring, not the client's one"
            ring = r
            assert len(ring.held) == 1, f"break-off {k}: slots held {ring.held}, one batch alive"
            assert within(held.images, ring_span(ring)), "the batch lies in the ring"
            check([held], held.sample_ids.tolist())
            if first is None:
                first = held.sample_ids.copy()
            np.testing.assert_array_equal(held.sample_ids, first, "same seed and epoch, same first batch")
            assert c.stats().shm_rings == 1, f"break-off {k}: the daemon keeps the one ring"
        # The next stream gets every free slot back: a whole epoch (30 batches, 10 slots) with
        # the held batch in one slot, every sample once, none of them in a message.
        ids = consume(c.stream("train", 10, seed=4, transport="shm"))
        assert sorted(ids) == list(range(300)), "every sample exactly once"
        check([held], held.sample_ids.tolist())  # still intact: the client holds its slot
        s = c.stats()
        assert s.shm_fallbacks == 0 and s.shm_batches >= 3 + 30, (s.shm_fallbacks, s.shm_batches)


def test_the_bytes_path_still_works_over_tcp_and_shm_needs_the_unix_socket(daemon):
    with larder.Client(daemon.tcp) as c:
        check(list(c.stream("train", 32, seed=1)), range(300))
        with pytest.raises(larder.LarderError, match="Unix socket"):
            next(c.stream("train", 32, transport="shm"))
        assert c.stats().shm_batches == 0


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {python!r})
    import larder
    c = larder.Client({address!r})
    s = c.stream("train", 10, transport="shm")
    b = next(s)
    print("streaming", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_client_frees_its_ring(daemon):
    pid = daemon.proc.pid
    dev_shm = set(os.listdir("/dev/shm"))
    with larder.Client(daemon.unix) as c:
        assert sorted(consume(c.stream("train", 10, transport="bytes"))) == list(range(300))  # warm
        base_rings, base_shmem = c.stats().shm_rings, rss_shmem_kb(pid)
        assert ring_maps(pid) == set(), "no ring yet"
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(python=str(REPO / "python"), address=daemon.unix)],
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout.readline().strip() == b"streaming"
            s = c.stats()
            assert s.shm_rings == base_rings + 1 and s.shm_bytes > 0
            assert rss_shmem_kb(pid) > base_shmem, "the daemon has written into the child's ring"
            # The ring is a memfd that both map (the same inode).
            (daemon_map,) = ring_maps(pid)
            assert daemon_map[2] in {inode for _, _, inode in ring_maps(child.pid)}, "the child maps that memfd"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        deadline = time.monotonic() + 10
        # The ring leaves the table when its connection closes, its memory when the stream
        # that was writing into it has stopped too.
        while time.monotonic() < deadline:
            s = c.stats()
            if (s.shm_rings, s.shm_bytes) == (base_rings, 0) and not ring_maps(pid):
                break
            time.sleep(0.05)
        assert (s.shm_rings, s.shm_bytes) == (base_rings, 0)
        # The daemon unmapped its side and holds no descriptor of it: once the child's mapping
        # went with the child, nothing holds the memory.
        assert ring_maps(pid) == set(), "the daemon still maps the ring"
        assert memfd_descriptors(pid) == [], "the daemon still holds a descriptor of the ring"
        assert rss_shmem_kb(pid) <= base_shmem, "the daemon's memory is back where it was"
    # The rings are anonymous memfds, never files: nothing was made in /dev/shm meanwhile.
    assert set(os.listdir("/dev/shm")) - dev_shm == set(), "nothing left in /dev/shm"


def _inode_at(address: int) -> int:
    """The inode of this process's mapping that holds `address`."""
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= address < hi:
            return int(parts[4])
    raise AssertionError(f"{address:#x} is in no mapping of this process")


def test_rings_are_memfds_the_daemon_unmaps_when_their_client_closes(daemon):
    pid = daemon.proc.pid
    dev_shm = set(os.listdir("/dev/shm"))
    clients = [larder.Client(daemon.unix) for _ in range(2)]
    try:
        for c in clients:
            assert sorted(consume(c.stream("train", 10, transport="shm"))) == list(range(300))
        # Each client keeps its ring (idle, for its next stream); the daemon maps both memfds,
        # each the one its client maps.
        inodes = []
        for c in clients:
            (ring,) = c._idle_rings
            inodes.append(_inode_at(ring_span(ring)[0]))
        assert {inode for _, _, inode in ring_maps(pid)} == set(inodes) and len(set(inodes)) == 2
        assert {inode for _, _, inode in ring_maps(os.getpid())} >= set(inodes)
        assert clients[0].stats().shm_rings == 2
        for k, c in enumerate(clients):
            c.close()  # closes its ring's connection: the daemon frees that ring, the other stays
            deadline = time.monotonic() + 10
            while {i for _, _, i in ring_maps(pid)} != set(inodes[k + 1:]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert {i for _, _, i in ring_maps(pid)} == set(inodes[k + 1:]), f"after client {k} closed"
    finally:
        for c in clients:
            c.close()
    with larder.Client(daemon.unix) as c:
        s = c.stats()
        assert (s.shm_rings, s.shm_bytes) == (0, 0)
    assert memfd_descriptors(pid) == [], "the daemon still holds a descriptor of a ring"
    assert set(os.listdir("/dev/shm")) - dev_shm == set(), "nothing made in /dev/shm"


OTHER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {python!r})
    import grpc
    from larder.v1 import larder_pb2 as pb, larder_pb2_grpc as pbg
    ch = grpc.insecure_channel({address!r}, options=[("grpc.default_authority", "localhost")])
    req = pb.StreamBatchesRequest(dataset="train", batch_size=10, layout_version=1,
                                  shm_ring=bytes.fromhex({token!r}))
    try:
        next(iter(pbg.LarderStub(ch).StreamBatches(req)))
        print("SERVED")
    except grpc.RpcError as e:
        print(e.code().name, e.details())
    """
)


def test_a_ring_cannot_be_used_by_another_process(daemon):
    with larder.Client(daemon.unix) as c:
        s = c.stream("train", 10, transport="shm")
        next(s)
        s.close()  # the ring goes back to the client's idle rings, still open
        (ring,) = c._idle_rings
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                OTHER.format(python=str(REPO / "python"), address=daemon.unix, token=ring.token.hex()),
            ],
            capture_output=True,
            check=True,
        ).stdout.decode()
        assert out.startswith("PERMISSION_DENIED"), out
        # A made-up token from this very process is refused too.
        stub_req = pb.StreamBatchesRequest(dataset="train", batch_size=10, layout_version=1, shm_ring=b"x" * 16)
        with pytest.raises(Exception, match="no shared-memory ring"):
            next(iter(c._stub.StreamBatches(stub_req)))


def test_rings_stay_within_the_daemon_cap_with_many_slow_clients(tmp_path):
    make_h5(tmp_path / "train.h5", 300)
    # Room for two rings of 10 slots of 10 samples (plus headers), not three.
    ring = 4096 + 10 * (-(-(10 * LENGTH + 64 + 128) // 4096) * 4096)
    d = Daemon(
        tmp_path,
        f'[[dataset]]\nname = "train"\npath = "{tmp_path / "train.h5"}"\nlabels = "labels"\n',
        extra=f"[shm]\nbudget_bytes = {2 * ring + 100}\n",
    )
    try:
        peak = []
        stop = threading.Event()

        def watch():
            with larder.Client(d.unix) as c:
                while not stop.is_set():
                    s = c.stats()
                    peak.append(s.shm_bytes)
                    assert s.shm_bytes <= s.shm_budget_bytes
                    time.sleep(0.01)

        results = {}

        def slow(k):
            with larder.Client(d.unix) as c:
                ids = []
                for b in c.stream("train", 10, seed=k):
                    ids.extend(int(i) for i in b.sample_ids)
                    time.sleep(0.01)
                results[k] = ids

        watcher = threading.Thread(target=watch)
        watcher.start()
        jobs = [threading.Thread(target=slow, args=(k,)) for k in range(5)]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        stop.set()
        watcher.join()
        assert all(sorted(ids) == list(range(300)) for ids in results.values()) and len(results) == 5
        assert max(peak) <= 2 * ring + 100
        with larder.Client(d.unix) as c:
            assert c.stats().shm_batches > 0, "the first clients got rings"
            with pytest.raises(larder.LarderError, match="shm.budget_bytes") as e:
                big = c.stream("train", 300, transport="shm")
                next(big)
            assert e.value.code.name == "RESOURCE_EXHAUSTED"
    finally:
        d.stop()


def test_rings_count_against_the_memory_budget_and_are_sized_to_the_prefetch_depths(daemon):
    """The memory tier leaves the rings room: while a ring is open the tier's limit is its
    budget less the ring's bytes, and it has it back when the ring closes. A ring has a slot
    for each batch the daemon assembles ahead (prefetch_batches, 4 by default), one on its way,
    the client's read-ahead and two for the loop: 9 with the defaults, not a fixed 10."""
    with larder.Client(daemon.unix) as c:
        before = c.stats()
        budget, footprint = before.memory_budget_bytes, before.footprint_bytes
        stream = c.stream("train", 10, seed=1, transport="shm", prefetch=2)
        next(stream)
        s = c.stats()
        assert s.shm_rings == 1 and s.shm_bytes > 0
        # The tier leaves room for the ring, the stream's future (the policy's) and what the
        # stream takes outside the cache (its plan and order: the footprint account).
        assert s.footprint_bytes > footprint
        assert s.memory_budget_bytes == budget - s.shm_bytes - s.memory_policy_bytes - (s.footprint_bytes - footprint)
        assert s.memory_bytes <= s.memory_budget_bytes
        slot = -(-(10 * LENGTH + 64 + 128) // 4096) * 4096
        assert s.shm_bytes == 4096 + 9 * slot, (s.shm_bytes, slot)
        for _ in stream:
            pass
    deadline = time.monotonic() + 10
    with larder.Client(daemon.unix) as c:
        while c.stats().shm_rings and time.monotonic() < deadline:
            time.sleep(0.05)
        s = c.stats()
        assert s.shm_rings == 0
        # Back, less the finished stream's next epoch the policy keeps in mind.
        assert s.memory_budget_bytes == budget - s.memory_policy_bytes


def test_the_mapping_goes_after_the_last_batch_from_it_and_is_mapped_until_then(daemon):
    """A pinned ring's CUDA registration is undone as the ring's array over the whole mapping
    goes (`Ring.pin` ties it to that array's life): not while a batch from the ring lives, and
    while the memory is still mapped (a registration left on an unmapped range keeps its pages
    locked and refuses the next ring mapped at that address)."""
    import gc
    import weakref

    c = larder.Client(daemon.unix)
    s = c.stream("train", 10, seed=4, transport="shm")
    held = next(s)
    s.close()
    (ring,) = c._idle_rings
    inode = _inode_at(ring_span(ring)[0])
    mapped_when_gone = []
    weakref.finalize(ring._all, lambda: mapped_when_gone.append(
        inode in {i for _, _, i in ring_maps(os.getpid())}))
    c.close()
    del ring, s, c
    gc.collect()
    assert mapped_when_gone == [], "a batch from the ring is alive: the mapping stays"
    check([held], held.sample_ids.tolist())
    del held
    deadline = time.monotonic() + 10
    while not mapped_when_gone and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert mapped_when_gone == [True], "gone with the last batch, the memory still mapped as it went"
    assert inode not in {i for _, _, i in ring_maps(os.getpid())}, "then unmapped"


class FakeCuda:
    """A stand-in for the CUDA calls a pinned ring makes, recording them: tests of the pinned
    ring's life on a machine without a GPU (gpu.py runs the real ones where one is lent)."""

    def __init__(self):
        self.calls = []
        self.ready = True  # whether copies queued so far have run
        fake = self

        class Event:
            def record(self):
                fake.calls.append(("event",))

            def query(self):
                return fake.ready

        self.Event = Event

    def cudart(self):
        return self

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0

    def synchronize(self):
        self.calls.append(("synchronize",))


def test_a_pinned_rings_registration_and_release_without_a_gpu(daemon, monkeypatch):
    """With CUDA's calls stood in for: a stream with pin_memory registers its ring once (the
    whole mapping); a slot whose batch is gone is handed back only once the copies queued
    before are done; the registration is undone once, after a synchronize, as the last batch
    goes, while the memory is still mapped."""
    torch = pytest.importorskip("torch")
    import gc
    import weakref

    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", cuda.cudart)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    pinned = []
    pin = larder.shm.Ring.pin
    monkeypatch.setattr(larder.shm.Ring, "pin", lambda self: (pinned.append(self), pin(self))[1])
    c = larder.Client(daemon.unix)
    s = c.stream("train", 10, seed=4, transport="shm", pin_memory=True, prefetch=2)
    first = next(s)
    (ring,) = pinned
    registered = [k for k in cuda.calls if k[0] == "register"]
    assert registered == [("register", ring._all.ctypes.data, ring.size)], cuda.calls
    # A batch let go while the copies queued before have not run (the stream lets go of it
    # as the next comes): its slot stays this process's (pending), and is handed back once
    # they have.
    cuda.ready = False
    del first
    held = next(s)
    gc.collect()
    assert ring._pending, "freed before the copies queued from it ran"
    cuda.ready = True
    ring.poll()
    assert not ring._pending, "handed back once they ran"
    s.close()
    inode = _inode_at(ring_span(ring)[0])
    mapped_when_gone = []
    weakref.finalize(ring._all, lambda: mapped_when_gone.append(
        inode in {i for _, _, i in ring_maps(os.getpid())}))
    c.close()
    pinned.clear()
    del ring, s, c
    gc.collect()
    assert not [k for k in cuda.calls if k[0] == "unregister"], "a batch from the ring is alive"
    del held
    deadline = time.monotonic() + 10
    while not mapped_when_gone and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert mapped_when_gone == [True], "gone with the last batch, the memory still mapped as it went"
    unregistered = [i for i, k in enumerate(cuda.calls) if k[0] == "unregister"]
    assert len(unregistered) == 1 and cuda.calls[unregistered[0]][1] == registered[0][1], cuda.calls
    assert cuda.calls[unregistered[0] - 1] == ("synchronize",), "the queued copies finish first"


def test_a_client_whose_daemon_restarted_between_epochs_makes_a_new_ring(tmp_path):
    """A ring left idle after an epoch dies with the daemon that made it (an upgrade restarts
    it): the client's next epoch, on the restarted daemon, makes a new ring and is exact."""
    from conftest import h5_table

    make_h5(tmp_path / "a.h5", 64)
    d = Daemon(tmp_path, h5_table("a", tmp_path / "a.h5"))
    try:
        with larder.Client(d.unix, reconnect_timeout=30) as c:
            check(c.stream("a", 8, seed=1, epoch=0, transport="shm"), range(64))
            d.stop()
            d.start()
            check(c.stream("a", 8, seed=1, epoch=1, transport="shm"), range(64))
    finally:
        d.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace of its own for larderd needs root")
def test_a_client_the_daemon_cannot_name_gets_batches_in_messages(tmp_path):
    """larderd in a pid namespace of its own (a container's) cannot name a client outside it
    (the kernel says pid 0): its ring request is refused at once, and the default transport
    streams the epoch in messages, exactly."""
    from conftest import h5_table, larderd_binary

    make_h5(tmp_path / "a.h5", 64)
    sock = tmp_path / "larder.sock"
    config = tmp_path / "larder.toml"
    config.write_text(f'unix_socket = "{sock}"\nunix_socket_mode = 0o666\n[scratch]\nenabled = false\n'
                      + h5_table("a", tmp_path / "a.h5"))
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", str(larderd_binary()),
                             "--config", str(config)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while not sock.exists():
            assert proc.poll() is None and time.time() < deadline, "larderd did not start"
            time.sleep(0.05)
        with larder.Client(f"unix:{sock}") as c:
            check(c.stream("a", 8, seed=1), range(64))
            with pytest.raises(larder.LarderError, match="another pid namespace"):
                list(c.stream("a", 8, seed=1, transport="shm"))
    finally:
        proc.kill()  # unshare's --kill-child takes larderd with it
        proc.wait(timeout=20)
