"""larderd SIGKILLed mid-epoch and mid-warm, again and again, and started again on the same
config and scratch folder: a stream open across each kill goes on where it stopped, every
epoch after serves every sample exactly once and byte for byte, the shards written before a
kill are served (when valid) or discarded (when not: a record damaged on purpose here is
counted and refetched from raw storage, never served), and an interrupted warm resumes."""

import os
import pathlib
import signal
import struct
import threading
import time
import zlib

import h5py
import numpy as np

import pytest

import larder
from conftest import Daemon

N = 20000
DATASET = """
[[dataset]]
name = "crash"
path = "{path}"
[[dataset.field]]
name = "image"
[[dataset.field]]
name = "aux"
[[dataset.field]]
name = "label"
hdf5 = "labels"
"""


def write(path):
    rng = np.random.default_rng(11)
    with h5py.File(path, "w") as f:
        # Chunked: raw reads by granules of 64 samples, each filling the scratch tier at once.
        f.create_dataset("image", data=rng.integers(0, 256, (N, 3, 32, 32), dtype=np.uint8), chunks=(64, 3, 32, 32))
        f["aux"] = rng.standard_normal((N, 5)).astype(np.float32)
        f["labels"] = np.arange(N, dtype=np.int64) * 7 - 5


def check(batches, truth):
    """Sample ids of (sample ids, {field: array}) batches, each value checked against h5py's."""
    ids = []
    for sample_ids, fields in batches:
        for k, i in enumerate(sample_ids):
            for name in ("image", "aux", "label"):
                assert fields[name][k].tobytes() == truth[name][i].tobytes(), (name, int(i))
        ids.extend(int(i) for i in sample_ids)
    return ids


def whole_epoch(d, truth, epoch, **kw):
    with larder.Client(d.unix) as c:
        ids = check(((b.sample_ids, b) for b in c.stream("crash", 256, seed=3, epoch=epoch, **kw)), truth)
        assert sorted(ids) == list(range(N)), f"epoch {epoch}: every sample exactly once"
        return c.stats()


def shards(tmp_path) -> list:
    return sorted((tmp_path / "scratch").glob("crash-*/shard-*.bin"))


def records(tmp_path) -> int:
    """Samples with a valid index entry in the scratch tier's shards (as a restart finds them)."""
    return len({sample for path in shards(tmp_path) for sample, _, _ in entries(path)})


def warm_until(d, fraction):
    """Warms the dataset in a thread and SIGKILLs larderd once `fraction` of it is done (or
    the warm has ended). Returns the last progress seen and the warm's error."""
    seen, errors, reached = [], [], threading.Event()

    def warm():
        try:
            with larder.Client(d.unix) as c:
                for p in c.warm("crash"):
                    seen.append(p)
                    if p.done >= fraction * p.total:
                        reached.set()
        except larder.LarderError as e:
            errors.append(e)
        finally:
            reached.set()

    t = threading.Thread(target=warm)
    t.start()
    assert reached.wait(60), "the warm made no progress"
    d.stop(signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "the warm call did not end when larderd died"
    return (seen[-1] if seen else None), (errors[0] if errors else None)


@pytest.mark.quiet
def test_sigkill_mid_epoch_and_mid_warm_then_restart_serves_every_sample_exactly(tmp_path):
    path = tmp_path / "crash.h5"
    write(path)
    with h5py.File(path, "r") as f:
        truth = {"image": f["image"][()], "aux": f["aux"][()], "label": f["labels"][()]}
    # 60 MB of samples, shards of 1 MiB (about 330 records each): the daemon writes many
    # shard files, several at each kill. Its memory tier holds a sixth of the data.
    # Rings may take at most half the memory budget: room for a ring of 9 batches of 100 kB.
    d = Daemon(tmp_path, DATASET.format(path=path), scratch="shard_bytes = 1048576\n",
               budget_bytes=64_000_000)
    try:
        # A stream reads an epoch, slowly, across two kills mid-warm: it reconnects to each
        # restarted daemon and goes on at its next batch. Its batches are checked at the end.
        # In order: a shuffled one would fill the scratch tier at once (each sample's miss
        # reads its granule of 64), and the warm's kills would find nothing left to write.
        got, stream_errors, started, fast = [], [], threading.Event(), threading.Event()

        def slow_epoch():
            try:
                with larder.Client(d.unix, reconnect_timeout=60) as c:
                    for b in c.stream("crash", 32, shuffle=False):
                        got.append((b.sample_ids.copy(), {k: np.array(v) for k, v in b.items()}))
                        started.set()
                        if not fast.is_set():
                            time.sleep(0.01)
            except Exception as e:  # handed to the test
                stream_errors.append(e)
            finally:
                started.set()

        streamer = threading.Thread(target=slow_epoch)
        streamer.start()
        assert started.wait(30)
        written = [0]
        # Early enough that a warm which runs ahead of the progress its client has read yet
        # (about 16 messages may wait in between) is still writing when the kill lands.
        for fraction in (0.2, 0.4):
            progress, error = warm_until(d, fraction)
            assert progress is not None and progress.done < progress.total, f"killed mid-warm, at {progress}"
            assert error is not None and error.code.name == "UNAVAILABLE", error
            # Killed while it wrote the scratch tier: some records, not all, more each time.
            written.append(records(tmp_path))
            assert written[-2] < written[-1] < N, f"records in the shards after each kill: {written}"
            d.start()
        before = len(got)
        # The rest of the warm: the records from before the kills are kept, the others written.
        with larder.Client(d.unix) as c:
            last = list(c.warm("crash"))[-1]
        assert (last.done, last.total, last.bad) == (N, N, 0)
        assert last.present >= written[-1] and last.present + last.written == N, last
        fast.set()
        streamer.join(120)
        assert not streamer.is_alive() and not stream_errors, stream_errors
        assert 0 < before < len(got), "the stream was cut mid-epoch and went on"
        ids = check(got, truth)
        assert ids == list(range(N)), "the epoch across the kills: every sample exactly once, in order"

        # Killed mid-epoch (a stream open in shared memory, and one in messages) with every
        # record on disk: the restarted daemon rebuilds its index from the shards and serves
        # whole epochs from them, byte for byte.
        for k, transport in enumerate(["shm", "bytes"]):
            with larder.Client(d.unix) as c:
                stream = c.stream("crash", 64, seed=3, epoch=10 + k, transport=transport)
                first = [next(stream) for _ in range(3)]
                check(((b.sample_ids, b) for b in first), truth)
                d.stop(signal.SIGKILL)
                stream.close()
                del first
            d.start()
            s = whole_epoch(d, truth, 1 + k, transport=transport)
            tiers = {t.tier: t.hits for t in s.tiers}
            assert tiers["scratch"] > 0 and tiers["raw"] == 0, f"the shards were not served: {tiers}"

        # A record damaged after a kill (a flipped byte in its payload, as a torn or rotten
        # write would leave it) is never served: counted, discarded, refetched from raw.
        d.stop(signal.SIGKILL)
        damage_a_record(shards(tmp_path))
        d.start()
        corrupt = s.scratch_corrupt_records  # found in the same shards by the run before
        s = whole_epoch(d, truth, 5)
        assert s.scratch_corrupt_records == corrupt + 1, "the damaged record went unnoticed"
        assert {t.tier: t.hits for t in s.tiers}["raw"] >= 1
        whole_epoch(d, truth, 6)  # and the sample's new copy serves from then on
    finally:
        d.stop()


def entries(shard: pathlib.Path) -> list:
    """The valid index entries of `shard` (layout: src/tiers/scratch/shard.rs): (sample, offset,
    length) of each record, read from the back of the file, holes (entries of zeros) skipped.
    None for a file a crash left without its header (allocated, the header not yet written),
    which the daemon removes at start."""
    data = shard.read_bytes()
    if data[:8] != b"LARDSHD3" or struct.unpack_from("<Q", data, 32)[0] != len(data):
        return []
    capacity = len(data)
    out, holes, at = [], 0, capacity - 24
    while at >= 64 and holes < 256:
        sample, offset, length, _, entry_crc = struct.unpack_from("<QIIII", data, at)
        if data[at : at + 24] == bytes(24):
            holes += 1
        elif zlib.crc32(data[at : at + 20]) == entry_crc and 64 <= offset and offset + length <= at:
            out.append((sample, offset, length))
            holes = 0
        else:
            break  # the records' end (or a torn entry)
        at -= 24
    return out


def damage_a_record(paths: list) -> int:
    """Flips a byte in the middle of the payload of a record whose sample has no other record
    in any shard (so it is the copy a restarted daemon serves); returns the sample."""
    where = {}
    for path in paths:
        for sample, offset, length in entries(path):
            where.setdefault(sample, []).append((path, offset, length))
    sample, [(path, offset, length)] = next((s, w) for s, w in sorted(where.items()) if len(w) == 1)
    at = offset + length // 2
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
    return sample
