"""Data where users keep it: NumPy arrays (np.save, np.savez, np.savez_compressed), Hugging Face
datasets (save_to_disk), Parquet shards, WebDataset tars and BasicSR's LMDB environments, each
written by the format's own library, served by a real larderd and compared byte for byte with
what that library reads."""

import os
import pathlib
import subprocess
import time

import numpy as np
import pytest

import larder
from conftest import Daemon

N = 53


def arrays():
    rng = np.random.default_rng(4)
    return {
        "image": rng.integers(0, 256, (N, 3, 8, 6), dtype=np.uint8),
        "flow": rng.standard_normal((N, 2, 4)).astype(np.float32),
        "half": rng.standard_normal((N, 5)).astype(np.float16),
        "label": np.arange(N, dtype=np.int64) * 7 - 100,
        "mask": rng.integers(0, 2, (N, 3)).astype(bool),
    }


def check_epochs(client, name, truth, epochs=2, batch=8):
    for epoch in range(epochs):
        seen = []
        for b in client.stream(name, batch, seed=11, epoch=epoch):
            assert sorted(b) == sorted(truth)
            for k, i in enumerate(b.sample_ids):
                for field, values in truth.items():
                    want = values[i].astype(np.uint8) if values.dtype == bool else values[i]
                    assert b[field][k].dtype == want.dtype, field
                    assert b[field][k].tobytes() == want.tobytes(), (field, i)
            seen.extend(int(i) for i in b.sample_ids)
        assert sorted(seen) == list(range(N)), "every sample exactly once"


@pytest.mark.parametrize("layout", ["folder", "savez", "savez_compressed"])
def test_numpy_arrays_are_served_as_numpy_reads_them(tmp_path, layout):
    truth = arrays()
    if layout == "folder":
        path = tmp_path / "arrays"
        path.mkdir()
        for k, v in truth.items():
            np.save(path / f"{k}.npy", v)
    else:
        path = tmp_path / "arrays.npz"
        getattr(np, layout)(path, **truth)
    # What numpy itself reads back is the truth.
    if layout == "folder":
        truth = {k: np.load(path / f"{k}.npy", mmap_mode="r") for k in truth}
    else:
        with np.load(path) as z:
            truth = {k: z[k] for k in z.files}
    d = Daemon(tmp_path, f'[[dataset]]\nname = "np"\npath = "{path}"\n')
    try:
        with larder.Client(d.unix) as c:
            info = c.dataset("np")
            assert info.kind == "npy"
            fields = {f.name: f for f in info.fields}
            assert (fields["image"].dtype, list(fields["image"].shape)) == ("uint8", [3, 8, 6])
            assert (fields["half"].dtype, fields["label"].dtype) == ("float16", "int64")
            assert list(fields["label"].shape) == []
            check_epochs(c, "np", truth)
    finally:
        d.stop()


def test_numpy_fields_by_name_and_clear_errors(tmp_path):
    path = tmp_path / "a"
    path.mkdir()
    truth = arrays()
    np.save(path / "x.npy", truth["image"])
    np.save(path / "y.npy", truth["label"])
    np.save(path / "short.npy", truth["label"][:5])
    np.save(path / "big_endian.npy", truth["label"].astype(">i8"))
    table = (
        f'[[dataset]]\nname = "picked"\npath = "{path}"\nkind = "npy"\n'
        '[[dataset.field]]\nname = "img"\narray = "x"\n[[dataset.field]]\nname = "y"\n'
    )
    d = Daemon(tmp_path, table)
    try:
        with larder.Client(d.unix) as c:
            check_epochs(c, "picked", {"img": truth["image"], "y": truth["label"]}, epochs=1)
            for fields, says in [
                ({"y": "y", "s": "short"}, "differ in length"),
                ({"b": "big_endian"}, "other byte order"),
                ({"n": "nope"}, 'no array "nope"'),
            ]:
                extra = {"field": [{"name": k, "array": v} for k, v in fields.items()]}
                with pytest.raises(larder.LarderError, match=says):
                    c.add_dataset("bad", path, kind="npy", **extra)
    finally:
        d.stop()


def hf_dataset(n=37):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(9)
    features = datasets.Features({
        "image": datasets.Image(),
        "label": datasets.ClassLabel(names=["cat", "dog", "eel"]),
        "grid": datasets.Array2D(shape=(2, 3), dtype="float32"),
        "seq": datasets.Sequence(datasets.Value("int16")),
        "caption": datasets.Value("string"),
        "flag": datasets.Value("bool"),
    })
    rows = {
        "image": [Image.fromarray(rng.integers(0, 256, (9 + i % 5, 7 + i % 3, 3), dtype=np.uint8)) for i in range(n)],
        "label": [i % 3 for i in range(n)],
        "grid": [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(n)],
        "seq": [list(rng.integers(-500, 500, 4)) for _ in range(n)],
        "caption": [f"row {i}" for i in range(n)],
        "flag": [bool(i % 2) for i in range(n)],
    }
    return datasets.Dataset.from_dict(rows, features=features)


def check_hf_epoch(client, name, ds):
    seen = []
    for b in client.stream(name, 8, seed=5):
        assert "caption" not in b, "text is left out"
        for k, i in enumerate(b.sample_ids):
            row = ds[int(i)]
            hwc = np.asarray(row["image"].convert("RGB"))
            img = b["image"][k]
            h, w = hwc.shape[:2]
            assert img[:, :h, :w].transpose(1, 2, 0).tobytes() == hwc.tobytes(), i
            assert b["label"][k] == row["label"]
            assert b["grid"][k].tobytes() == np.asarray(row["grid"], np.float32).tobytes()
            assert b["seq"][k][: len(row["seq"])].tobytes() == np.asarray(row["seq"], np.int16).tobytes()
            assert b["flag"][k] == int(row["flag"])
        seen.extend(int(i) for i in b.sample_ids)
    assert sorted(seen) == list(range(len(ds))), ("every sample exactly once", client.bad_samples(name))


def test_hugging_face_save_to_disk_is_served_as_the_library_reads_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "hf"
    hf_dataset().save_to_disk(str(path))
    dd = datasets.DatasetDict({"train": hf_dataset(23), "test": hf_dataset(11)})
    dd.save_to_disk(str(tmp_path / "dict"))
    tables = (
        f'[[dataset]]\nname = "hf"\npath = "{path}"\nresize = 0\ncrop = 0\n'
        f'[[dataset]]\nname = "test"\npath = "{tmp_path / "dict"}"\nsplit = "test"\nresize = 0\ncrop = 0\n'
    )
    d = Daemon(tmp_path, tables)
    try:
        with larder.Client(d.unix) as c:
            info = c.dataset("hf")
            assert info.kind == "hf"
            fields = {f.name: f for f in info.fields}
            assert sorted(fields) == ["flag", "grid", "image", "label", "seq"]
            assert (fields["grid"].dtype, list(fields["grid"].shape)) == ("float32", [2, 3])
            assert (fields["label"].dtype, fields["seq"].dtype) == ("int64", "int16")
            assert "(a row at a time)" not in info.source, "lists of numbers: whole batches"
            assert "caption" in info.source, "the text column is listed as left out"
            check_hf_epoch(c, "hf", datasets.load_from_disk(str(path)))
            check_hf_epoch(c, "test", datasets.load_from_disk(str(tmp_path / "dict"))["test"])
            with pytest.raises(larder.LarderError, match='no split "val"'):
                c.add_dataset("val", tmp_path / "dict", kind="hf", split="val")
            with pytest.raises(larder.LarderError, match="caption"):
                c.add_dataset("text", path, kind="hf", field=[{"name": "caption"}])
    finally:
        d.stop()


def test_hugging_face_images_and_labels_are_read_a_row_at_a_time(tmp_path):
    """Images with plain-number columns are read straight from the batch's buffers, a row at a
    time: the same bytes, a missing image a bad sample."""
    datasets = pytest.importorskip("datasets")
    ds = hf_dataset(29).remove_columns(["grid", "seq", "caption"])
    rows = ds.to_dict()
    rows["image"][7] = None
    ds = datasets.Dataset.from_dict(rows, features=ds.features)
    path = tmp_path / "plain"
    ds.save_to_disk(str(path))
    d = Daemon(tmp_path, f'[[dataset]]\nname = "plain"\npath = "{path}"\nresize = 0\ncrop = 0\n')
    try:
        with larder.Client(d.unix) as c:
            truth = datasets.load_from_disk(str(path))
            seen = []
            for b in c.stream("plain", 8, seed=2):
                for k, i in enumerate(b.sample_ids):
                    row = truth[int(i)]
                    hwc = np.asarray(row["image"].convert("RGB"))
                    h, w = hwc.shape[:2]
                    assert b["image"][k][:, :h, :w].transpose(1, 2, 0).tobytes() == hwc.tobytes(), i
                    assert b["label"][k] == row["label"] and b["flag"][k] == int(row["flag"])
                seen.extend(int(i) for i in b.sample_ids)
            assert sorted(seen) == [i for i in range(29) if i != 7], "row 7 has no image"
            assert "(a row at a time)" in c.dataset("plain").source
            bad = c.bad_samples("plain")
            assert [b.index for b in bad] == [7] and "missing" in bad[0].error, bad
    finally:
        d.stop()


def test_parquet_shards_are_served_as_the_library_reads_them(tmp_path):
    datasets = pytest.importorskip("datasets")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    data = tmp_path / "hub" / "data"
    data.mkdir(parents=True)
    ds = hf_dataset(41)
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(str(data / f"train-0000{k}-of-00002.parquet"), batch_size=16)
    shards = sorted(str(p) for p in data.glob("train-*.parquet"))
    truth = datasets.load_dataset("parquet", data_files=shards, split="train", cache_dir=str(tmp_path / "cache"))
    # Plain pyarrow: uint8 stored as INT32 annotated unsigned, row groups of 7.
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, 30, dtype=np.uint8)
    v = [list(rng.integers(-9, 9, 3).astype(np.int32)) for _ in range(30)]
    pq.write_table(pa.table({"x": pa.array(x), "v": pa.array(v, pa.list_(pa.int32())), "s": ["a"] * 30}),
                   str(tmp_path / "plain.parquet"), row_group_size=7)
    tables = (
        f'[[dataset]]\nname = "hub"\nkind = "parquet"\npath = "{data}"\nresize = 0\ncrop = 0\n'
        f'[[dataset]]\nname = "glob"\nkind = "parquet"\npath = "{data}/train-*.parquet"\nresize = 0\ncrop = 0\n'
        f'[[dataset]]\nname = "plain"\npath = "{tmp_path / "plain.parquet"}"\n'
    )
    d = Daemon(tmp_path, tables)
    try:
        with larder.Client(d.unix) as c:
            info = c.dataset("hub")
            assert info.kind == "parquet"
            fields = {f.name: f for f in info.fields}
            assert (fields["grid"].dtype, list(fields["grid"].shape)) == ("float32", [2, 3])
            check_hf_epoch(c, "hub", truth)
            check_hf_epoch(c, "glob", truth)
            assert c.dataset("plain").kind == "parquet"
            seen = []
            for b in c.stream("plain", 4, seed=1):
                for k, i in enumerate(b.sample_ids):
                    assert b["x"][k] == x[i] and b["x"][k].dtype == np.uint8
                    assert b["v"][k][:3].tobytes() == np.asarray(v[i], np.int32).tobytes()
                    assert "s" not in b
                seen.extend(int(i) for i in b.sample_ids)
            assert sorted(seen) == list(range(30))
    finally:
        d.stop()


def test_hugging_face_jpegs_are_turned_upright_as_datasets_turns_them(tmp_path):
    """A phone photo stored sideways with an EXIF orientation: served as `datasets` decodes it
    (upright), for each of the eight orientations."""
    datasets = pytest.importorskip("datasets")
    import io

    from PIL import Image

    y, x = np.mgrid[0:24, 0:40]
    base = np.stack([x * 6, y * 10, (x + y) * 3], -1).astype(np.uint8)
    images = []
    for o in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = o
        buf = io.BytesIO()
        Image.fromarray(base).save(buf, format="JPEG", quality=95, exif=exif.tobytes())
        images.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image()})
    path = tmp_path / "phone"
    datasets.Dataset.from_dict({"image": images}, features=features).save_to_disk(str(path))
    d = Daemon(tmp_path, f'[[dataset]]\nname = "phone"\npath = "{path}"\nresize = 0\ncrop = 0\n')
    try:
        truth = datasets.load_from_disk(str(path))
        with larder.Client(d.unix) as c:
            for b in c.stream("phone", 8):
                for k, i in enumerate(b.sample_ids):
                    want = np.asarray(truth[int(i)]["image"].convert("RGB")).astype(int)
                    h, w = want.shape[:2]
                    assert (h, w) == ((24, 40) if i < 4 else (40, 24)), (i, want.shape)
                    got = b["image"][k][:, :h, :w].transpose(1, 2, 0).astype(int)
                    assert got.shape == want.shape, (i + 1, got.shape, want.shape)
                    assert np.abs(got - want).mean() < 1.0, f"orientation {i + 1}"
    finally:
        d.stop()


def test_new_kinds_shard_across_ranks_and_resume_exactly(tmp_path):
    """DDP ranks of an npy, an hf, a webdataset and an lmdb dataset together read each sample
    once; a rank resumed mid-epoch reads exactly the rest of its shard."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "np").mkdir()
    np.save(tmp_path / "np" / "x.npy", np.arange(N * 4, dtype=np.int32).reshape(N, 4))
    hf_dataset(N).remove_columns(["grid", "seq", "caption"]).save_to_disk(str(tmp_path / "hf"))
    wds = pytest.importorskip("webdataset")
    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "s-%03d.tar"), maxcount=20, verbose=0) as sink:
        for i in range(N):
            sink.write({"__key__": f"k{i:04d}", "cls": i})
    rng = np.random.default_rng(0)
    basicsr_lmdb(tmp_path / "lmdb", [rng.integers(0, 256, (3, 2, 3), dtype=np.uint8) for _ in range(N)],
                 [f"{i:05d}" for i in range(N)])
    tables = (f'[[dataset]]\nname = "np"\npath = "{tmp_path / "np"}"\n'
              f'[[dataset]]\nname = "hf"\npath = "{tmp_path / "hf"}"\nresize = 0\ncrop = 0\n'
              f'[[dataset]]\nname = "wds"\nkind = "webdataset"\npath = "{tmp_path / "wds"}"\n'
              f'[[dataset]]\nname = "lmdb"\npath = "{tmp_path / "lmdb"}"\n')
    d = Daemon(tmp_path, tables)
    try:
        with larder.Client(d.unix) as c:
            for name in ["np", "hf", "wds", "lmdb"]:
                shards = [[int(i) for b in c.stream(name, 5, seed=3, rank=r, world_size=3, even_batches=False) for i in b.sample_ids]
                          for r in range(3)]
                assert sorted(sum(shards, [])) == list(range(N)), name
                whole = [int(i) for b in c.stream(name, 5, seed=3, rank=1, world_size=3) for i in b.sample_ids]
                rest = [int(i) for b in c.stream(name, 5, seed=3, rank=1, world_size=3, start_step=2)
                        for i in b.sample_ids]
                assert rest == whole[10:], name
    finally:
        d.stop()


def test_webdataset_shards_are_served_as_webdataset_reads_them(tmp_path):
    wds = pytest.importorskip("webdataset")
    import io

    from PIL import Image

    rng = np.random.default_rng(6)
    shards = tmp_path / "shards"
    shards.mkdir()
    n = 23
    with wds.ShardWriter(str(shards / "train-%06d.tar"), maxcount=10) as sink:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (6 + i % 4, 9, 3), dtype=np.uint8)).save(buf, format="PNG")
            sink.write({"__key__": f"s{i:05d}", "png": buf.getvalue(), "cls": i % 5,
                        "npy": rng.standard_normal((2, 3)).astype(np.float32), "json": {"i": i}})
    names = sorted(str(p) for p in shards.glob("*.tar"))
    truth = list(wds.WebDataset(names, shardshuffle=False).decode("rgb8"))
    assert len(truth) == n
    # A copy of the last shard cut in the middle of a member.
    cut = tmp_path / "cut"
    cut.mkdir()
    data = pathlib.Path(names[-1]).read_bytes()
    at = data.rfind(b"s00022.png")
    assert at > 0
    (cut / "train-000002.tar").write_bytes(data[: at + 600])  # inside the last member's bytes
    tables = (
        f'[[dataset]]\nname = "wds"\npath = "{shards}/train-{{000000..000002}}.tar"\n'
        'kind = "webdataset"\nresize = 0\ncrop = 0\n'
        f'[[dataset]]\nname = "cut"\npath = "{cut}"\nkind = "webdataset"\nresize = 0\ncrop = 0\n'
    )
    d = Daemon(tmp_path, tables)
    try:
        with larder.Client(d.unix) as c:
            info = c.dataset("wds")
            assert info.kind == "webdataset" and "json" in info.source
            fields = {f.name: f for f in info.fields}
            assert (fields["cls"].dtype, fields["npy"].dtype, list(fields["npy"].shape)) == ("int64", "float32", [2, 3])
            seen = []
            for b in c.stream("wds", 4, seed=8):
                for k, i in enumerate(b.sample_ids):
                    t = truth[int(i)]
                    h, w = t["png"].shape[:2]
                    assert b["png"][k][:, :h, :w].transpose(1, 2, 0).tobytes() == t["png"].tobytes(), i
                    assert b["cls"][k] == t["cls"]
                    assert b["npy"][k].tobytes() == t["npy"].tobytes()
                seen.extend(int(i) for i in b.sample_ids)
            assert sorted(seen) == list(range(n)), "every sample exactly once"
            # The cut shard: only its complete samples, never the cut one; it says so.
            info = c.dataset("cut")
            assert "cut short" in info.source
            got = sorted(int(i) for b in c.stream("cut", 4) for i in b.sample_ids)
            assert got == [0, 1], "samples s00020 and s00021; s00022 was cut"
            with pytest.raises(larder.LarderError, match="compressed"):
                gz = tmp_path / "x.tar.gz"
                gz.write_bytes(b"")
                c.add_dataset("gz", gz, kind="webdataset")
    finally:
        d.stop()


def test_a_numpy_file_that_changes_is_never_served_as_what_it_held(tmp_path):
    """Rewritten under the daemon: a stream then gets the new values or a clear error naming the
    change, never the old bytes as if they were the file's."""
    path = tmp_path / "ch"
    path.mkdir()
    np.save(path / "x.npy", np.zeros((N, 4), np.int32))
    d = Daemon(tmp_path, f'[[dataset]]\nname = "ch"\npath = "{path}"\n', budget_bytes=0)
    try:
        with larder.Client(d.unix) as c:
            assert all(not b["x"].any() for b in c.stream("ch", 8))
            np.save(path / "x.npy", np.ones((N + 3, 4), np.int32))
            deadline = time.time() + 20
            while True:
                try:
                    values = [b["x"] for b in c.stream("ch", 8, epoch=1)]
                except larder.LarderError as e:
                    assert "chang" in str(e), e
                else:
                    if all(v.all() for v in values):
                        break  # reopened: the new file's values, and only those
                    assert not any(v.any() for v in values), "old and new mixed"
                assert time.time() < deadline, "never saw the change"
                time.sleep(0.5)
    finally:
        d.stop()


def basicsr_lmdb(path, images, keys, meta_order=None):
    """An LMDB environment as BasicSR's `make_lmdb_from_imgs` writes it: each key's image as a
    PNG (compression level 1), keys in sorted order, and `meta_info.txt` listing
    `key.png (h,w,c) 1` (in `meta_order` when given)."""
    lmdb = pytest.importorskip("lmdb")
    import io

    from PIL import Image

    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for key, img in sorted(zip(keys, images)):
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG", compress_level=1)
            txn.put(key.encode("ascii"), buf.getvalue())
    env.close()
    shape = {k: img.shape for k, img in zip(keys, images)}
    with open(path / "meta_info.txt", "w") as f:
        for key in meta_order or sorted(keys):
            h, w, c = shape[key]
            f.write(f"{key}.png ({h},{w},{c}) 1\n")


def test_basicsr_lmdb_pairs_are_served_as_basicsr_reads_them(tmp_path):
    """High- and low-resolution environments paired by key, in meta_info.txt's order, each
    image byte for byte what LMDB get + decode gives; the train pipeline's crops aligned (the
    high-resolution box 4x the low one) on every sample."""
    lmdb = pytest.importorskip("lmdb")
    import io

    from PIL import Image

    rng = np.random.default_rng(9)
    n = 29
    keys = [f"{i // 4 + 1:04d}_s{i % 4 + 1:03d}" for i in range(n)]
    lq = [rng.integers(0, 256, (12, 12, 3), dtype=np.uint8) for _ in range(n)]
    gt = [np.kron(x, np.ones((4, 4, 1), dtype=np.uint8)) for x in lq]  # 48 x 48, each LR pixel 4 x 4
    order = keys[::-1]  # meta_info's order, not the keys' sorted order
    sr = tmp_path / "sr"
    sr.mkdir()
    basicsr_lmdb(sr / "lq.lmdb", lq, keys, order)
    basicsr_lmdb(sr / "gt.lmdb", gt, keys, order)
    # What BasicSR reads: get the key's bytes, decode, RGB.
    truth = {}
    for name in ["lq", "gt"]:
        env = lmdb.open(str(sr / f"{name}.lmdb"), readonly=True, lock=False)
        with env.begin() as txn:
            truth[name] = [np.asarray(Image.open(io.BytesIO(txn.get(k.encode()))).convert("RGB")) for k in order]
        env.close()
    before = {p: p.stat().st_mtime_ns for p in sr.rglob("*")}
    tables = (f'[[dataset]]\nname = "sr"\nkind = "lmdb"\npath = "{sr}"\nresize = 0\ncrop = 0\n'
              '[[dataset.field]]\nname = "lq"\nlmdb = "lq.lmdb"\n'
              '[[dataset.field]]\nname = "gt"\nlmdb = "gt.lmdb"\npair = { with = "lq", scale = 4 }\n'
              f'[[dataset]]\nname = "crops"\nkind = "lmdb"\npath = "{sr}"\nresize = 0\ncrop = 8\n'
              '[[dataset.field]]\nname = "lq"\nlmdb = "lq.lmdb"\n'
              '[[dataset.field]]\nname = "gt"\nlmdb = "gt.lmdb"\npair = { with = "lq", scale = 4 }\n'
              '[dataset.train]\n'
              f'[[dataset]]\nname = "hr"\npath = "{sr / "gt.lmdb"}"\nresize = 0\ncrop = 0\n')
    d = Daemon(tmp_path, tables)
    try:
        with larder.Client(d.unix) as c:
            info = c.dataset("sr")
            assert info.kind == "lmdb" and "meta_info.txt" in info.source
            for epoch in range(2):
                seen = []
                for b in c.stream("sr", 6, seed=2, epoch=epoch):
                    for k, i in enumerate(b.sample_ids):
                        for name in ["lq", "gt"]:
                            assert b[name][k].transpose(1, 2, 0).tobytes() == truth[name][int(i)].tobytes(), (name, i)
                    seen.extend(int(i) for i in b.sample_ids)
                assert sorted(seen) == list(range(n)), "every sample exactly once"
            # Recognised by its data.mdb; one field, the image.
            assert c.dataset("hr").kind == "lmdb"
            got = {int(i): b["image"][k] for b in c.stream("hr", 8) for k, i in enumerate(b.sample_ids)}
            assert all(got[i].transpose(1, 2, 0).tobytes() == truth["gt"][i].tobytes() for i in range(n))
            # Train crops: the HR crop is the LR crop's box at 4x, flips and all.
            crops = 0
            for b in c.stream("crops", 5, pipeline="train", seed=4):
                assert b["lq"].shape[1:] == (3, 8, 8) and b["gt"].shape[1:] == (3, 32, 32)
                for k in range(len(b.sample_ids)):
                    up = np.kron(b["lq"][k], np.ones((1, 4, 4), dtype=np.uint8))
                    assert (b["gt"][k] == up).all(), int(b.sample_ids[k])
                    crops += 1
            assert crops == n
    finally:
        d.stop()
    # Read as MDB_RDONLY | MDB_NOLOCK would: nothing in the users' folders was written.
    assert {p: p.stat().st_mtime_ns for p in sr.rglob("*")} == before


def test_lmdb_errors_name_the_key_and_the_file(tmp_path):
    pytest.importorskip("lmdb")
    rng = np.random.default_rng(1)
    imgs = [rng.integers(0, 256, (4, 4, 3), dtype=np.uint8) for _ in range(5)]
    keys = [f"k{i}" for i in range(5)]
    basicsr_lmdb(tmp_path / "a.lmdb", imgs, keys)
    basicsr_lmdb(tmp_path / "b.lmdb", imgs[:4], keys[:4])
    (tmp_path / "c.lmdb").mkdir()
    (tmp_path / "c.lmdb" / "data.mdb").write_bytes(b"\0" * 8192)
    d = Daemon(tmp_path, "")
    try:
        with larder.Client(d.unix) as c:
            with pytest.raises(larder.LarderError, match=r'b.lmdb has no key "k4" \(listed in .*meta_info.txt\)'):
                c.add_dataset("pair", tmp_path, kind="lmdb",
                              field=[{"name": "x", "lmdb": "a.lmdb"}, {"name": "y", "lmdb": "b.lmdb"}])
            with pytest.raises(larder.LarderError, match=r"c.lmdb/data.mdb.*not an LMDB data file"):
                c.add_dataset("forged", tmp_path / "c.lmdb")
    finally:
        d.stop()


def test_a_cold_shuffled_epoch_reads_each_raw_byte_about_once(tmp_path):
    """Measured from outside, by what the daemon's process read (/proc/PID/io rchar) during
    one cold shuffled epoch of a webdataset and an lmdb dataset: at most 1.3x the bytes their
    samples take in the files; sample by sample without a scratch tier, and with one a
    webdataset miss reads its whole shard (a granule) in one read into the scratch tier."""
    wds = pytest.importorskip("webdataset")
    pytest.importorskip("lmdb")
    import io

    from PIL import Image

    rng = np.random.default_rng(3)
    n = 150
    imgs = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(n)]
    pngs = []
    for img in imgs:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG", compress_level=1)
        pngs.append(buf.getvalue())
    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "s-%03d.tar"), maxcount=40, verbose=0) as sink:
        for i, png in enumerate(pngs):
            sink.write({"__key__": f"k{i:04d}", "png": png, "cls": i})
    basicsr_lmdb(tmp_path / "env.lmdb", imgs, [f"{i:04d}_s001" for i in range(n)])
    stored = sum(len(p) for p in pngs)
    tables = (f'[[dataset]]\nname = "wds"\nkind = "webdataset"\npath = "{tmp_path / "wds"}"\nresize = 0\ncrop = 0\n'
              f'[[dataset]]\nname = "lmdb"\npath = "{tmp_path / "env.lmdb"}"\nresize = 0\ncrop = 0\n')
    for scratch in ["enabled = false\n", ""]:
        d = Daemon(tmp_path, tables, scratch=scratch)

        def rchar():
            return int(next(line.split()[1] for line in open(f"/proc/{d.proc.pid}/io") if line.startswith("rchar")))

        try:
            with larder.Client(d.unix) as c:
                assert {x.name for x in c.datasets()} == {"wds", "lmdb"}  # both opened: headers read
                for name in ["wds", "lmdb"]:
                    before = rchar()
                    tiers_before = {t.tier: (t.hits, t.bytes) for t in c.stats().tiers}
                    got = sorted(int(i) for b in c.stream(name, 16, seed=5) for i in b.sample_ids)
                    read = rchar() - before
                    tiers = {t.tier: (t.hits - tiers_before[t.tier][0], t.bytes - tiers_before[t.tier][1])
                             for t in c.stats().tiers}
                    assert got == list(range(n))
                    if scratch:
                        # Every read the process made: each raw byte about once.
                        assert read <= 1.3 * stored, f"{name}: {read} bytes read for {stored} stored"
                    elif name == "wds":
                        # A miss reads its shard whole (40 samples, one read) into the scratch
                        # tier: 4 raw reads for 4 shards, every other sample a scratch hit. (The
                        # process's rchar counts the scratch tier's reads too: the raw bytes are
                        # the source's count here.)
                        assert tiers["raw"] == (4, tiers["raw"][1]), tiers
                        assert tiers["scratch"][0] == n - 4, tiers
                        assert tiers["raw"][1] <= 1.3 * stored, tiers
        finally:
            d.stop()


def test_the_libraries_default_layouts_open_and_serve_through_readers(request):
    """WebDataset shards of 1,200 samples (webdataset's TarWriter), a Hugging Face dataset of
    3,000 rows saved by save_to_disk (record batches of 1,000 rows) and the same rows written
    by to_parquet (its writer's default row groups), served through readers as the shipped
    config has it (as root, readers as `nobody`; else in the daemon): each opens, and every
    sample comes once, as the format's own library reads it."""
    wds = pytest.importorskip("webdataset")
    datasets = pytest.importorskip("datasets")
    import io
    import shutil
    import tempfile

    from PIL import Image

    # Where the readers' user (nobody, as root) may read.
    root = pathlib.Path(tempfile.mkdtemp(prefix="larder-layouts-"))
    root.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    rng = np.random.default_rng(12)
    (root / "wds").mkdir()
    n = 2400
    for k in range(2):
        with wds.TarWriter(str(root / "wds" / f"train-{k:06d}.tar")) as sink:
            for i in range(k * 1200, (k + 1) * 1200):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, format="PNG")
                sink.write({"__key__": f"s{i:05d}", "png": buf.getvalue(), "cls": i % 7})
    truth = list(wds.WebDataset(sorted(str(p) for p in (root / "wds").glob("*.tar")), shardshuffle=False)
                 .decode("rgb8"))
    assert len(truth) == n
    rows = datasets.Dataset.from_dict({"v": [[float(i), float(-i)] for i in range(3000)],
                                       "label": list(range(3000))})
    rows.save_to_disk(str(root / "hf"))
    (root / "parquet").mkdir()
    rows.to_parquet(str(root / "parquet" / "train.parquet"))
    reader = 'reader_user = "nobody"\n' if os.geteuid() == 0 else ""
    tables = "".join(
        f'[[dataset]]\nname = "{name}"\nkind = "{kind}"\npath = "{root / name}"\nresize = 0\ncrop = 0\n'
        f'allow = ["all"]\n' for name, kind in [("wds", "webdataset"), ("hf", "hf"), ("parquet", "parquet")])
    d = Daemon(root, tables, top=reader)
    try:
        with larder.Client(d.unix) as c:
            for name in ("wds", "hf", "parquet"):
                assert c.dataset(name).num_samples == (n if name == "wds" else 3000), name
            seen = []
            for b in c.stream("wds", 64, seed=2):
                for k, i in enumerate(b.sample_ids):
                    t = truth[int(i)]
                    assert b["png"][k].transpose(1, 2, 0).tobytes() == t["png"].tobytes(), i
                    assert b["cls"][k] == t["cls"]
                seen.extend(int(i) for i in b.sample_ids)
            assert sorted(seen) == list(range(n)), "every sample exactly once"
            for name in ("hf", "parquet"):
                seen = []
                for b in c.stream(name, 100, seed=3):
                    for k, i in enumerate(b.sample_ids):
                        assert b["label"][k] == int(i) and b["v"][k].tolist() == [float(i), -float(i)], (name, i)
                    seen.extend(int(i) for i in b.sample_ids)
                assert sorted(seen) == list(range(3000)), name
        if reader:
            procs = subprocess.run(["ps", "-eo", "user=,args="], capture_output=True, text=True).stdout
            assert sum(line.split()[0] == "nobody" and "larder-child reader" in line
                       for line in procs.splitlines()) == 3, procs
    finally:
        d.stop()
