"""Float and multi-field datasets over shared memory: an HDF5 file written by h5py with float32,
float64, float16, int16, uint32 and uint8 fields and int64 labels, streamed over the Unix socket
into the client's ring (cold from raw storage, warm from the memory tier, after a restart from
the scratch tier, whole and by rank, all fields and some), every value of every field compared
byte for byte with what h5py reads. test_fields.py checks these kinds over the message path."""

import h5py
import numpy as np
import pytest

import larder
from conftest import Daemon, in_a_ring

N = 203  # a multiple of none of the batch sizes: every epoch ends on a short batch

FIELDS = """
[[dataset]]
name = "typed"
path = "{path}"
[[dataset.field]]
name = "image"
[[dataset.field]]
name = "flow"
[[dataset.field]]
name = "depth"
[[dataset.field]]
name = "clip"
[[dataset.field]]
name = "half"
[[dataset.field]]
name = "count"
[[dataset.field]]
name = "label"
hdf5 = "labels"
"""

# name: (dtype, sample shape). The uint8 image first, 105 bytes a sample, so the fields after
# it start wherever the daemon lays them out in the slot.
SPEC = {
    "image": (np.uint8, (3, 5, 7)),
    "flow": (np.float32, (2, 3)),
    "depth": (np.float64, (4,)),
    "clip": (np.int16, (5,)),
    "half": (np.float16, (3,)),
    "count": (np.uint32, ()),
    "label": (np.int64, ()),
}


def write(path):
    """Random values, and in the float fields the values a conversion would lose or change:
    NaNs with payloads, signed zeros, infinities, subnormals, the extremes."""
    rng = np.random.default_rng(7)
    flow = rng.standard_normal((N, 2, 3)).astype(np.float32) * 1e3
    flow.reshape(-1)[:8] = np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000, 0xFF800000, 1, 0x807FFFFF,
                                     0x7F7FFFFF], dtype=np.uint32).view(np.float32)
    depth = rng.standard_normal((N, 4)) * 1e-300
    depth.reshape(-1)[:6] = np.array([0x7FF8000000000ABC, 0x8000000000000000, 0x7FF0000000000000, 1,
                                      0x7FEFFFFFFFFFFFFF, 0xFFF0000000000000], dtype=np.uint64).view(np.float64)
    half = rng.standard_normal((N, 3)).astype(np.float16)
    half.reshape(-1)[:4] = np.array([0x7E01, 0x8000, 0x0001, 0xFBFF], dtype=np.uint16).view(np.float16)
    with h5py.File(path, "w") as f:
        f["image"] = rng.integers(0, 256, (N, 3, 5, 7), dtype=np.uint8)
        # Chunked and compressed: raw reads by chunk (granules), then decompressed.
        f.create_dataset("flow", data=flow, chunks=(16, 2, 3), compression="gzip")
        f["depth"] = depth
        f["clip"] = rng.integers(-32768, 32768, (N, 5), dtype=np.int16)
        f["half"] = half
        f["count"] = rng.integers(0, 2**32, N, dtype=np.uint32)
        f["labels"] = rng.integers(-(2**62), 2**62, N, dtype=np.int64)


@pytest.fixture
def typed(tmp_path):
    path = tmp_path / "typed.h5"
    write(path)
    with h5py.File(path, "r") as f:
        truth = {name: f["labels" if name == "label" else name][()] for name in SPEC}
    for name, (dtype, shape) in SPEC.items():
        assert truth[name].dtype == dtype and truth[name].shape == (N,) + shape, name
    d = Daemon(tmp_path, FIELDS.format(path=path))
    yield d, truth
    d.stop()


def check_stream(stream, truth, batch_size, fields=tuple(SPEC)):
    """Reads a stream as a training loop does (each batch dropped before the next): every batch
    in the ring, its fields those asked for, with their dtypes and shapes, and every value of
    every sample the bytes h5py read. Returns the sample ids in the order served and the
    number of batches."""
    ids, batches = [], 0
    for b in stream:
        batches += 1
        assert list(b) == list(fields)
        assert 0 < b.size <= batch_size
        for name in fields:
            dtype, shape = SPEC[name]
            arr = b[name]
            assert arr.dtype == dtype and arr.shape == (b.size,) + shape, (name, arr.dtype, arr.shape)
            assert in_a_ring(arr), f"{name}: not in a shared-memory ring this process maps"
            assert arr.flags.aligned, f"{name}: at {arr.__array_interface__['data'][0]:#x}, not aligned"
            for k, i in enumerate(b.sample_ids):
                assert arr[k].tobytes() == truth[name][i].tobytes(), (name, int(i))
        ids.extend(int(i) for i in b.sample_ids)
    assert batches > 0
    return ids, batches


def test_every_value_of_every_field_byte_exact_through_the_ring(typed):
    d, truth = typed
    with larder.Client(d.unix) as c:
        fields = {f.name: f for f in c.dataset("typed").fields}
        for name, (dtype, shape) in SPEC.items():
            assert (fields[name].dtype, tuple(fields[name].shape)) == (np.dtype(dtype).name, shape), name
        assert c.plan("typed", 16).slot_bytes > 0, "fixed-size fields: a batch fits a slot"
        served = 0
        # Cold (every sample from raw storage), then from the memory tier, whole epochs.
        for epoch, bs in [(0, 16), (1, 7)]:
            ids, n = check_stream(c.stream("typed", bs, seed=1, epoch=epoch, transport="shm"), truth, bs)
            assert sorted(ids) == list(range(N)), f"epoch {epoch}: every sample exactly once"
            assert n == -(-N // bs)
            served += n
        # Two ranks, and some of the fields in another order.
        ranks = []
        for r in range(2):
            ids, n = check_stream(c.stream("typed", 10, seed=2, rank=r, world_size=2, transport="shm",
                                           even_batches=False), truth, 10)
            ranks += ids
            served += n
        assert sorted(ranks) == list(range(N)), "each sample on exactly one rank"
        picked = ("label", "flow", "half")
        ids, n = check_stream(c.stream("typed", 32, fields=list(picked), transport="shm"), truth, 32, picked)
        assert sorted(ids) == list(range(N))
        served += n
        s = c.stats()
        assert (s.shm_batches, s.shm_fallbacks) == (served, 0), "every batch in a slot, none in a message"
    # A restarted daemon serves the records from its scratch tier, through the ring alike.
    d.stop()
    d.start()
    with larder.Client(d.unix) as c:
        ids, _ = check_stream(c.stream("typed", 12, seed=5, transport="shm"), truth, 12)
        assert sorted(ids) == list(range(N))
        tiers = {t.tier: t.hits for t in c.stats().tiers}
        assert tiers["raw"] == 0 and tiers["scratch"] == N, tiers
