"""DDP ranks over an image folder with files that do not decode. The README ("Bad files"): a
sample whose files do not read or decode is skipped, "its batch comes with one sample fewer
(`sample_ids` says which it holds), so every rank still gets the same number of batches", and
every sample that decodes comes exactly once per epoch (up to DDP padding), a skipped one never.
Checked while the bad files are found (every rank streaming its first epoch at once) and once
they are known, on 2 and 3 ranks, shuffled and in order, in shared memory and in messages."""

import io
import threading

import numpy as np
from PIL import Image

import larder
from conftest import REPO, Daemon, in_a_ring

N = 20
# Sample i is the file i in class "a" (0-9) or "b" (10-19): the daemon's order, class by class,
# each class's files by name.
BAD = {
    4: "04.png",  # text, not an image
    5: "05.png",  # a PNG header followed by garbage
    13: "13.png",  # a real PNG cut in half
    17: "17.jpg",  # a real JPEG cut short
}
GOOD = sorted(set(range(N)) - set(BAD))


def image(i: int) -> np.ndarray:
    """Sample i's 8x8 RGB pixels: every value i, so a batch's pixels name their samples."""
    return np.full((8, 8, 3), i, dtype=np.uint8)


def make_folder(root):
    for i in range(N):
        cls = root / ("a" if i < 10 else "b")
        cls.mkdir(parents=True, exist_ok=True)
        if i in BAD:
            continue
        Image.fromarray(image(i)).save(cls / f"{i:02}.png")
    png = io.BytesIO()
    Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint32).astype(np.uint8).reshape(64, 64, 3)).save(png, "PNG")
    jpeg = (REPO / "tests" / "fixtures" / "parrots.jpg").read_bytes()
    (root / "a" / BAD[4]).write_bytes(b"this is not an image\n" * 10)
    (root / "a" / BAD[5]).write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (root / "b" / BAD[13]).write_bytes(png.getvalue()[: len(png.getvalue()) // 2])
    (root / "b" / BAD[17]).write_bytes(jpeg[:2000])


def epoch_of_every_rank(address, world, batch_size, at_once, transport="auto", **kw):
    """{rank: (batches planned, [batch, ...])} of one epoch of every rank, each batch (index,
    num_batches, sample ids); the ranks streaming at once (threads) or one after another."""
    out = {}

    def rank(r):
        batches = []
        with larder.Client(address) as c:
            planned = c.plan("pics", batch_size, rank=r, world_size=world, **kw).num_batches
            for b in c.stream("pics", batch_size, rank=r, world_size=world, transport=transport, **kw):
                ids = [int(i) for i in b.sample_ids]
                assert b["image"].shape == (len(ids), 3, 8, 8)
                if ids:
                    assert in_a_ring(b["image"]) == (transport != "bytes"), "in shared memory, or not"
                for k, i in enumerate(ids):
                    assert (b["image"][k] == i).all(), f"sample {i}'s pixels"
                    assert b["label"][k] == (0 if i < 10 else 1)
                batches.append((b.index, b.num_batches, ids))
        out[r] = (planned, batches)

    if at_once:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for r in range(world):
            rank(r)
    assert sorted(out) == list(range(world)), "a rank failed"
    return out


def check(out, world, batch_size, what):
    counts = {r: len(batches) for r, (_, batches) in out.items()}
    assert len(set(counts.values())) == 1, f"{what}: batches per rank {counts}"
    for r, (planned, batches) in out.items():
        assert planned == counts[r], f"{what}: rank {r} was planned {planned} batches, got {counts[r]}"
        assert [i for i, _, _ in batches] == list(range(counts[r])), f"{what}: rank {r}'s batch indexes"
        assert all(n == counts[r] for _, n, _ in batches), f"{what}: rank {r}'s num_batches"
        assert all(len(ids) <= batch_size for _, _, ids in batches)
    ids = [i for _, batches in out.values() for _, _, b in batches for i in b]
    assert not set(ids) & set(BAD), f"{what}: bad samples served: {sorted(set(ids) & set(BAD))}"
    assert sorted(set(ids)) == GOOD, f"{what}: missing {sorted(set(GOOD) - set(ids))}"
    assert len(ids) - len(GOOD) < world, f"{what}: {len(ids) - len(GOOD)} samples twice (padding < world)"
    return counts[0]


def test_every_rank_gets_as_many_batches_when_bad_files_are_skipped(tmp_path):
    make_folder(tmp_path / "pics")
    d = Daemon(tmp_path, f'[[dataset]]\nname = "pics"\nkind = "images"\npath = "{tmp_path / "pics"}"\n'
                         "resize = 8\ncrop = 8\n")
    try:
        # First epoch: the ranks find the bad files while they stream, all at once. In order
        # (shuffle=False) on 2 ranks of batches of 2, rank 0's batch 1 is samples 4 and 5, both
        # bad: it comes empty, and rank 0 still gets as many batches as rank 1.
        out = epoch_of_every_rank(d.unix, 2, 2, at_once=True, shuffle=False)
        assert check(out, 2, 2, "in order, 2 ranks, first epoch") == 5
        assert out[0][1][1] == (1, 5, []), "the batch of two bad samples comes, empty"
        with larder.Client(d.unix) as c:
            bad = {b.index: b.error for b in c.bad_samples("pics")}
            assert sorted(bad) == sorted(BAD), bad
            assert all(BAD[i] in why for i, why in bad.items()), bad
            assert c.stats().bad_samples == len(BAD)
        # Then with the bad files known, at once and one rank after another, shuffled and not,
        # on 2 and 3 ranks, even batches padded or the short round dropped, in shared memory
        # (the default on the Unix socket) and in messages.
        cases = [
            (2, 2, dict(shuffle=False)),
            (3, 2, dict(shuffle=False)),
            (3, 3, dict(seed=1)),
            (2, 3, dict(seed=2, epoch=1)),
            (3, 2, dict(seed=3, drop_last=True)),
            (3, 2, dict(seed=4, transport="bytes")),
            (2, 1, dict(seed=5, transport="bytes")),
        ]
        for world, bs, kw in cases:
            for at_once in (True, False):
                what = f"{world} ranks, batches of {bs}, {kw}, at once {at_once}"
                out = epoch_of_every_rank(d.unix, world, bs, at_once, **kw)
                if kw.get("drop_last"):  # the short last round dropped: no padding, some left out
                    counts = {(planned, len(b)) for planned, b in out.values()}
                    assert len(counts) == 1 and len(set(counts.pop())) == 1, f"{what}: batches {counts}"
                    ids = [i for _, b in out.values() for _, _, x in b for i in x]
                    assert not set(ids) & set(BAD) and len(ids) == len(set(ids)), what
                else:
                    check(out, world, bs, what)
    finally:
        d.stop()
