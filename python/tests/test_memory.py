"""The daemon's memory stays bounded while clients come and go: a minute of message-path
streams, each with a batch size no stream before it had, over fixed-size images and
variable-length clips (every batch of those a size of its own). Before the message buffers
were counted by their allocation, this grew the daemon by hundreds of MB a minute and kept it.
benches/soak.py is the long version, with rings, cancelled and killed clients."""

import os
import time

import h5py
import numpy as np

import larder
from conftest import Daemon, torch
import pytest

# A test of the daemon, not of the client's dependencies: run once, in the main environment.
pytestmark = pytest.mark.skipif(torch is None, reason="daemon test; runs in the main environment")

N = 2000
SECONDS = float(os.environ.get("LARDER_MEMORY_TEST_SECONDS", 60))
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
