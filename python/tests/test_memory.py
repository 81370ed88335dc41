"""The daemon's memory stays bounded while clients come and go: 25 s of message-path streams
(LARDER_MEMORY_TEST_SECONDS), each with a batch size no stream before it had, over fixed-size
images and variable-length clips (every batch of those a size of its own). A daemon that does
not count its message buffers by their allocation grows by gigabytes in that time (4.8 GB in
40 s) and keeps it; the bound is 64 MB. benches/soak.py is the long version, with rings,
cancelled and killed clients."""

import os
import threading
import time

import h5py
import numpy as np

import larder
from conftest import Daemon, torch
import pytest

# A test of the daemon, not of the client's dependencies: run once, in the main environment.
pytestmark = pytest.mark.skipif(torch is None, reason="daemon test; runs in the main environment")

N = 2000
SECONDS = float(os.environ.get("LARDER_MEMORY_TEST_SECONDS", 25))
WARM_UP = SECONDS / 4
MB = 1 << 20

DATASETS = """
[[dataset]]
name = "images"
path = "{path}"
labels = "labels"
[[dataset]]
name = "clips"
path = "{path}"
[[dataset.field]]
name = "clip"
[[dataset.field]]
name = "label"
hdf5 = "labels"
"""


def anonymous_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def write_data(path):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["images"] = rng.integers(0, 256, (N, 3, 64, 64), dtype=np.uint8)
        f["labels"] = np.arange(N, dtype=np.int64)
        clips = f.create_dataset("clip", (N,), dtype=h5py.vlen_dtype(np.int16))
        for i in range(N):
            clips[i] = rng.integers(-3000, 3000, (i * 37) % 6000, dtype=np.int16)


def test_message_path_memory_stays_flat_under_many_batch_sizes(tmp_path):
    write_data(tmp_path / "data.h5")
    d = Daemon(tmp_path, DATASETS.format(path=tmp_path / "data.h5"))
    try:
        c = larder.Client(d.unix)
        start = time.monotonic()
        samples, streams, size = [], 0, 17  # (seconds, anonymous bytes) after each stream
        while time.monotonic() - start < SECONDS:
            size = size % 509 + 3  # 20, 23, ... : a new batch size for every stream
            name = "clips" if streams % 2 else "images"
            layout = "offsets" if streams % 4 == 1 else "padded"
            seen = []
            for b in c.stream(name, size, seed=streams, transport="bytes", variable_layout=layout):
                seen.extend(b.sample_ids)
            assert sorted(seen) == list(range(N)), f"stream {streams} ({name}, batch {size})"
            streams += 1
            samples.append((time.monotonic() - start, anonymous_bytes(d.proc.pid)))
        # The level of each 5 s window (its median: freed pages go back to the kernel within a
        # second, so single samples swing by tens of MB); growth is the highest level after the
        # warm-up window over the warm-up window's.
        windows = {}
        for t, anon in samples:
            if t >= WARM_UP:
                windows.setdefault(int((t - WARM_UP) // 5), []).append(anon)
        levels = [float(np.median(windows[k])) for k in sorted(windows)]
        assert len(levels) >= 4 and streams > 20, (len(levels), streams)
        grown = max(levels[1:]) - levels[0]
        assert grown < 64 * MB, (
            f"the daemon's anonymous memory grew by {grown / MB:.0f} MB after warm-up, "
            f"per 5 s: {[round(v / MB) for v in levels]} MB, over {streams} streams"
        )

        # One account: what the daemon counts adds up, and the kernel's view is there too.
        s = c.stats()
        assert s.accounted_bytes == (
            s.memory_bytes + s.shm_bytes + s.message_buffer_spare_bytes + s.message_buffer_in_flight_bytes
            + s.footprint_bytes
        )
        assert s.anonymous_bytes > 0 and s.resident_bytes >= s.anonymous_bytes
        assert s.anonymous_ceiling_bytes > s.memory_budget_bytes
        assert s.message_buffer_spare_bytes <= 64 * MB

        # Idle: spare buffers unused for 10 s are freed, and none is in flight.
        deadline = time.monotonic() + 30
        while c.stats().message_buffer_spare_bytes and time.monotonic() < deadline:
            time.sleep(0.5)
        s = c.stats()
        assert (s.message_buffer_spare_bytes, s.message_buffer_in_flight_bytes) == (0, 0)
        assert s.anonymous_bytes <= s.anonymous_ceiling_bytes, (s.anonymous_bytes, s.anonymous_ceiling_bytes)
    finally:
        d.stop()


# The daemon's real footprint against its budgets (README, "Memory"): while it streams a
# dataset several times its memory tier, over shared memory and in messages at once, the kernel's
# count of its anonymous memory stays within the memory tier's budget + the spare message
# buffers' cap + the batches in flight + the allowance for everything else, and its shared
# memory within its rings.
BIG_N = 20000  # 3x64x64 uint8 samples: 246 MB, 7.7x the memory tier below
TIER_BYTES = 32_000_000
SPARE_BYTES = 16 << 20
PREFETCH_BATCHES = 4  # the daemon's default (deploy/larder.toml)
BATCH = 128
# src/alloc.rs UNACCOUNTED_ALLOWANCE, the README's "128 MiB for everything else (code, the async
# runtime, HTTP/2 buffers, datasets' indexes, HDF5's caches)", which benches/soak.py checks too.
ALLOWANCE = 128 * MB


def status(pid: int) -> dict:
    """RssAnon, RssShmem and VmRSS of process `pid`, in bytes, from /proc/PID/status."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssShmem", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def test_real_rss_stays_within_the_budgets_streaming_a_dataset_larger_than_them(tmp_path):
    rng = np.random.default_rng(1)
    with h5py.File(tmp_path / "big.h5", "w") as f:
        f["images"] = rng.integers(0, 256, (BIG_N, 3, 64, 64), dtype=np.uint8)
        f["labels"] = np.arange(BIG_N, dtype=np.int64)
    sample_bytes = 3 * 64 * 64 + 8
    # No scratch tier: every miss is a raw read, and the daemon maps no shard files.
    d = Daemon(tmp_path, f'[[dataset]]\nname = "big"\npath = "{tmp_path / "big.h5"}"\nlabels = "labels"\n',
               scratch="enabled = false\n", budget_bytes=TIER_BYTES, extra=f"message_buffers_bytes = {SPARE_BYTES}\n")
    samples, rings, errors, stop = [], [], [], threading.Event()

    def sample_memory():
        while not stop.is_set():
            samples.append(status(d.proc.pid))
            time.sleep(0.01)

    def two_epochs(transport, seed):
        try:
            with larder.Client(d.unix) as c:
                for epoch in range(2):
                    ids = []
                    for b in c.stream("big", BATCH, seed=seed, epoch=epoch, transport=transport):
                        np.testing.assert_array_equal(b.labels, b.sample_ids)
                        ids.extend(b.sample_ids.tolist())
                    assert sorted(ids) == list(range(BIG_N))
                if transport == "shm":
                    (ring,) = c._idle_rings
                    rings.append(ring.size)
        except Exception as e:  # handed to the test
            errors.append(e)

    try:
        watcher = threading.Thread(target=sample_memory)
        watcher.start()
        # Two clients at once, each streaming the dataset twice: one in shared memory, one in
        # messages (the spare buffers and the batches in flight).
        jobs = [threading.Thread(target=two_epochs, args=(t, k)) for k, t in enumerate(["shm", "bytes"])]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        stop.set()
        watcher.join()
        assert not errors, errors
        with larder.Client(d.unix) as c:
            s = c.stats()
    finally:
        stop.set()
        d.stop()
    assert len(samples) > 20 and len(rings) == 1
    # The tier's limit: the budget less the rings open, the message path's share (a quarter of
    # so small a budget) and the streams' futures it keeps.
    assert s.message_budget_bytes == TIER_BYTES // 4
    limit = TIER_BYTES - s.shm_bytes - s.message_budget_bytes - s.memory_policy_bytes
    # While the shared-memory client streamed, its ring took its bytes off that limit too (its
    # client has closed it since): the tier was filled to what was left.
    assert s.memory_budget_bytes == limit, "the tier's limit"
    assert s.memory_bytes > (limit - sum(rings)) // 2, "the tier was filled"
    # Batches in flight: each stream's prefetch_batches + 2 (README, "Memory"), each counted
    # twice (the batch's buffer or samples, and its encoded copy).
    in_flight = 2 * (PREFETCH_BATCHES + 2) * BATCH * sample_bytes * 2
    ceiling = TIER_BYTES + SPARE_BYTES + in_flight + ALLOWANCE
    peak = {key: max(x[key] for x in samples) for key in ("RssAnon", "RssShmem", "VmRSS")}
    seen = ", ".join(f"{k} {v / MB:.0f} MiB" for k, v in peak.items())
    seen += f"; anonymous ceiling {ceiling / MB:.0f} MiB, rings {sum(rings) / MB:.0f} MiB"
    assert peak["RssAnon"] <= ceiling, seen
    assert peak["RssShmem"] <= sum(rings), seen
    # Everything resident (code and libraries too, within the allowance) within the same.
    assert peak["VmRSS"] <= ceiling + sum(rings), seen
