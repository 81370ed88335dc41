"""Samples as named, typed fields, end to end: files written by h5py and Pillow, a real larderd,
real gRPC; every value compared with what h5py and Pillow read themselves."""

import h5py
import numpy as np
import pytest
from PIL import Image

import larder
from conftest import Daemon, needs_torch, torch

N = 75

SR_FIELDS = """
[[dataset]]
name = "mixed"
path = "{path}"
[[dataset.field]]
name = "lr"
[[dataset.field]]
name = "hr"
pair = {{ with = "lr", scale = 4 }}
[[dataset.field]]
name = "flow"
[[dataset.field]]
name = "depth"
[[dataset.field]]
name = "clip"
[[dataset.field]]
name = "valid"
[[dataset.field]]
name = "label"
hdf5 = "labels"
"""


def write_mixed(path):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["lr"] = rng.integers(0, 256, (N, 3, 4, 4), dtype=np.uint8)
        f.create_dataset("hr", data=rng.integers(0, 256, (N, 3, 16, 16), dtype=np.uint8), chunks=(8, 3, 16, 16), compression="gzip")
        f["flow"] = rng.standard_normal((N, 2, 4, 4)).astype(np.float32)
        f["depth"] = rng.standard_normal((N, 4)).astype(np.float16)
        clips = f.create_dataset("clip", (N,), dtype=h5py.vlen_dtype(np.int16))
        for i in range(N):
            clips[i] = rng.integers(-30000, 30000, (i * 7) % 23, dtype=np.int16)
        f["valid"] = rng.integers(0, 2, N).astype(bool)
        f["labels"] = np.arange(N, dtype=np.int64) * 3


@pytest.fixture
def mixed(tmp_path):
    path = tmp_path / "mixed.h5"
    write_mixed(path)
    d = Daemon(tmp_path, SR_FIELDS.format(path=path))
    with h5py.File(path, "r") as f:
        truth = {k: f[k][()] for k in ["lr", "hr", "flow", "depth", "clip", "valid", "labels"]}
    yield d, truth
    d.stop()


def check_epoch(batches, truth, layout="padded"):
    ids = []
    for b in batches:
        assert list(b) == ["lr", "hr", "flow", "depth", "clip", "valid", "label"]
        for name, dtype in [("lr", np.uint8), ("hr", np.uint8), ("flow", np.float32),
                            ("depth", np.float16), ("clip", np.int16), ("valid", np.uint8),
                            ("label", np.int64)]:
            arr = b[name].values if isinstance(b[name], larder.Ragged) else b[name]
            assert arr.dtype == dtype, name
        for k, i in enumerate(b.sample_ids):
            for name in ["lr", "hr", "flow", "depth"]:
                assert b[name][k].tobytes() == truth[name][i].tobytes(), (name, i)
            assert b["valid"][k] == int(truth["valid"][i])
            assert b["label"][k] == truth["labels"][i]
            clip = truth["clip"][i]
            assert b.lengths["clip"][k, 0] == len(clip)
            if layout == "padded":
                assert b["clip"][k, : len(clip)].tobytes() == clip.tobytes()
                assert not b["clip"][k, len(clip):].any(), "padded with zeros"
            else:
                assert b["clip"][k].tobytes() == clip.tobytes()
        if layout == "padded":
            assert b["clip"].shape == (b.size, max(b.lengths["clip"][:, 0]))
        ids.extend(int(i) for i in b.sample_ids)
    assert sorted(ids) == list(range(N)), "every sample exactly once"


def test_every_field_byte_exact_and_exactly_once(mixed):
    d, truth = mixed
    with larder.Client(d.unix) as c:
        info = c.dataset("mixed")
        fields = {f.name: f for f in info.fields}
        assert (fields["hr"].dtype, list(fields["hr"].shape)) == ("uint8", [3, 16, 16])
        assert (fields["hr"].paired_with, fields["hr"].scale) == ("lr", 4)
        assert (fields["clip"].dtype, list(fields["clip"].shape)) == ("int16", [-1])
        assert (fields["label"].dtype, list(fields["label"].shape)) == ("int64", [])
        assert fields["depth"].dtype == "float16"
        check_epoch(list(c.stream("mixed", 16, seed=3)), truth)
        check_epoch(list(c.stream("mixed", 16, seed=3, epoch=1, variable_layout="offsets")), truth, "offsets")
        # Picked fields, in the order asked for.
        b = next(c.stream("mixed", 8, fields=["label", "clip"]))
        assert list(b) == ["label", "clip"]
        with pytest.raises(larder.LarderError, match="fields are: lr, hr, flow"):
            next(c.stream("mixed", 8, fields=["nope"]))
    # A restarted daemon serves the variable-size records from its scratch tier.
    d.stop()
    d.start()
    with larder.Client(d.unix) as c:
        check_epoch(list(c.stream("mixed", 10, seed=9)), truth)
        tiers = {t.tier: t.hits for t in c.stats().tiers}
        assert tiers["raw"] == 0 and tiers["scratch"] == N


@needs_torch
def test_torch_gets_dicts_or_the_fields_asked_for(mixed):
    import larder.torch

    d, truth = mixed
    ds = larder.torch.LarderIterableDataset("mixed", 16, address=d.unix, seed=1)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    first = batches[0]
    assert isinstance(first, dict)
    assert first["flow"].dtype == torch.float32 and first["clip"].dtype == torch.int16
    assert first["clip_lengths"].shape == (first["clip"].shape[0], 1)
    assert sorted(int(i) for b in batches for i in b["label"] // 3) == list(range(N))
    pairs = larder.torch.LarderIterableDataset("mixed", 16, address=d.unix, fields=("lr", "hr", "clip_lengths"))
    lr, hr, lengths = next(iter(pairs))
    assert lr.shape[1:] == (3, 4, 4) and hr.shape[1:] == (3, 16, 16) and lengths.dtype == torch.int64


def test_image_folders_with_masks_keep_class_ids(tmp_path):
    root = tmp_path / "seg"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rng = np.random.default_rng(1)
    truth = {}
    palette = [v for i in range(256) for v in (255 - i, (i * 40) % 256, 7)]
    for i in range(12):
        h, w = 10 + i, 14 + 2 * (i % 3)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ids = (np.arange(w)[None, :] // 3 + np.arange(h)[:, None] // 4).astype(np.uint8) % 5
        Image.fromarray(img).save(root / "images" / f"{i:03}.png")
        mask = Image.fromarray(ids, mode="P")
        mask.putpalette(palette)
        mask.save(root / "masks" / f"{i:03}.png")
        truth[i] = (img.transpose(2, 0, 1), ids)
    def seg(name, size):
        return f"""
[[dataset]]
name = "{name}"
kind = "images"
path = "{root}"
resize = {size}
crop = {size}
[[dataset.field]]
name = "image"
folder = "images"
[[dataset.field]]
name = "mask"
folder = "masks"
mode = "index"
"""

    # Whole images of their own sizes, and resized + cropped to 8x8.
    datasets = seg("seg", 0) + seg("seg-small", 8)
    d = Daemon(tmp_path, datasets)
    try:
        with larder.Client(d.unix) as c:
            fields = {f.name: f for f in c.dataset("seg").fields}
            assert list(fields["image"].shape) == [3, -1, -1] and list(fields["mask"].shape) == [-1, -1]
            assert (fields["mask"].paired_with, fields["mask"].resample) == ("image", "nearest")
            seen = []
            for b in c.stream("seg", 5, seed=2):
                for k, i in enumerate(b.sample_ids):
                    img, ids = truth[int(i)]
                    (hl, wl), (hm, wm) = b.lengths["image"][k], b.lengths["mask"][k]
                    assert (hl, wl) == (hm, wm) == ids.shape
                    np.testing.assert_array_equal(b["image"][k, :, :hl, :wl], img)
                    np.testing.assert_array_equal(b["mask"][k, :hm, :wm], ids, "ids, not palette colours")
                    seen.append(int(i))
            assert sorted(seen) == list(range(12))
            for b in c.stream("seg-small", 4):
                assert b["image"].shape[1:] == (3, 8, 8) and b["mask"].shape[1:] == (8, 8)
                assert set(np.unique(b["mask"])) <= set(range(5)), "resized masks are never blended"
    finally:
        d.stop()


def test_bad_fields_stop_nothing_silently(tmp_path):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.zeros((64, 3, 4, 4), np.uint8)
        f["masks"] = np.zeros((65, 4, 4), np.uint8)
        f["names"] = np.array([b"a"] * 64)
    cases = [
        ('[[dataset.field]]\nname = "image"\nhdf5 = "images"\n[[dataset.field]]\nname = "mask"\nhdf5 = "masks"\n',
         'fields "image" and "mask"'),
        ('[[dataset.field]]\nname = "image"\nhdf5 = "images"\n[[dataset.field]]\nname = "name"\nhdf5 = "names"\n',
         'field "name" (HDF5 dataset "names"'),
        ('[[dataset.field]]\nname = "image"\nhdf5 = "pictures"\n', '"pictures"'),
    ]
    # A dataset whose fields are wrong is logged, left out and named in its streams' error;
    # the daemon serves the others.
    tables = "".join(
        f'[[dataset]]\nname = "bad{k}"\npath = "{path}"\n' + fields for k, (fields, _) in enumerate(cases)
    )
    good = tmp_path / "good.h5"
    with h5py.File(good, "w") as f:
        f["images"] = np.zeros((8, 3, 4, 4), np.uint8)
    d = Daemon(tmp_path, tables + f'[[dataset]]\nname = "good"\npath = "{good}"\n')
    try:
        with larder.Client(d.unix) as c:
            assert [x.name for x in c.datasets()] == ["good"]
            assert sum(len(b.sample_ids) for b in c.stream("good", 4)) == 8
            for k, (_, message) in enumerate(cases):
                with pytest.raises(larder.LarderError) as e:
                    next(iter(c.stream(f"bad{k}", 4)))
                assert "did not open" in str(e.value) and message in str(e.value), str(e.value)
        log = (tmp_path / "larderd.log").read_text()
        for k, (_, message) in enumerate(cases):
            assert f'dataset="bad{k}"' in log or f"bad{k}" in log, log
            assert message in log, log
    finally:
        d.stop()