"""Image folders through a real larderd: files of every common kind decoded as PIL would,
seeded per-epoch augmentation (train) and the center crop (eval), the CIFAR recipe on HDF5
arrays, and files that do not decode skipped, listed and counted, or failing the stream."""

import pathlib
import subprocess

import h5py
import numpy as np
import pytest
from PIL import Image

from conftest import REPO, Daemon, larder_binary

from larder import Client, LarderError

PARROTS = REPO / "tests" / "fixtures" / "parrots.jpg"  # a real photo, 384x256


def photos(root: pathlib.Path) -> list:
    """A folder of real-photo JPEGs of several sizes and aspect ratios (crops of parrots.jpg
    re-encoded), in two classes; returns the paths in the daemon's sample order."""
    base = Image.open(PARROTS).convert("RGB")
    boxes = [(0, 0, 384, 256), (40, 10, 300, 250), (100, 0, 260, 256), (0, 30, 384, 200),
             (10, 10, 210, 240), (150, 50, 384, 256)]
    paths = []
    for i, box in enumerate(boxes):
        cls = root / ("a" if i % 2 == 0 else "b")
        cls.mkdir(parents=True, exist_ok=True)
        p = cls / f"p{i}.jpg"
        base.crop(box).save(p, quality=92)
        paths.append(p)
    return sorted(paths)


def epoch(client, dataset, *, batch_size=4, pipeline="eval", **kw):
    """{sample id: (image bytes copied, label)} of one whole epoch."""
    out = {}
    for b in client.stream(dataset, batch_size, pipeline=pipeline, **kw):
        for k, i in enumerate(b.sample_ids):
            assert int(i) not in out, f"sample {i} twice"
            out[int(i)] = (np.array(b["image"][k]), int(b["label"][k]))
    return out


def images_daemon(tmp_path, root, extra=""):
    return Daemon(tmp_path, f'[[dataset]]\nname = "pics"\nkind = "images"\npath = "{root}"\n{extra}')


def test_every_kind_of_file_decodes_as_pil_converts_it(tmp_path):
    root = tmp_path / "kinds" / "all"  # one class
    root.mkdir(parents=True)
    rng = np.random.default_rng(1)
    rgb = Image.open(PARROTS).convert("RGB").resize((96, 64))
    files = {
        "rgb.jpg": lambda p: rgb.save(p, quality=95),
        "grey.jpg": lambda p: rgb.convert("L").save(p, quality=95),
        "cmyk.jpg": lambda p: rgb.convert("CMYK").save(p, quality=95),
        "rgba.png": lambda p: Image.fromarray(np.dstack([np.asarray(rgb), rng.integers(0, 256, (64, 96), np.uint8)])).save(p),
        "grey.png": lambda p: rgb.convert("L").save(p),
        "palette.png": lambda p: rgb.convert("P").save(p),
        "rgb16.png": None,
        "grey16.png": None,
    }
    for name, make in files.items():
        if make is not None:
            make(root / name)
    # 16-bit files: PIL reads 16-bit RGB as its high bytes and clips 16-bit grey at 255 (it
    # has no 16-bit RGB mode), so the expected pixels are the values scaled to 8 bits.
    rgb16 = rng.integers(0, 65536, (64, 96, 3)).astype(np.uint16)
    grey16 = (np.arange(64 * 96).reshape(64, 96) * 10).astype(np.uint16)
    _png16(root / "rgb16.png", rgb16)
    Image.fromarray(grey16).save(root / "grey16.png")
    d = images_daemon(tmp_path, root.parent, "resize = 0\ncrop = 0\n")
    try:
        with Client(d.unix) as c:
            served = {}
            for b in c.stream("pics", 1, shuffle=False):
                (i,) = b.sample_ids
                n = int(b.lengths["image"][0][0]), int(b.lengths["image"][0][1])
                served[int(i)] = np.array(b["image"][0][:, : n[0], : n[1]])
        names = sorted(files)
        assert len(served) == len(names)
        for i, name in enumerate(names):
            got = served[i]
            if name == "rgb16.png":
                want = np.round(rgb16 / 257).astype(np.uint8)
            elif name == "grey16.png":
                want = np.repeat(np.round(grey16 / 257).astype(np.uint8)[..., None], 3, axis=2)
            else:
                want = np.asarray(Image.open(root / name).convert("RGB"))
            want = want.transpose(2, 0, 1)
            assert got.shape == want.shape, name
            diff = np.abs(got.astype(int) - want.astype(int))
            # JPEGs: libjpeg-turbo here and in Pillow's wheel may differ by a rounding step.
            assert diff.max() <= (2 if name.endswith(".jpg") else 1), f"{name}: max diff {diff.max()}"
    finally:
        d.stop()


def _png16(path, rgb16):
    """A 16-bit RGB PNG (PIL cannot write one)."""
    import struct
    import zlib

    h, w, _ = rgb16.shape
    raw = b"".join(b"\0" + rgb16[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


TRAIN = "resize = 96\ncrop = 64\n[dataset.train]\n"


def test_train_crops_are_seeded_per_epoch_and_eval_is_the_center(tmp_path):
    paths = photos(tmp_path / "photos")
    d = images_daemon(tmp_path, tmp_path / "photos", TRAIN)
    try:
        with Client(d.unix) as c:
            info = c.dataset("pics")
            assert info.has_train_pipeline
            assert list(info.fields[0].shape) == [3, 64, 64]
            e0 = epoch(c, "pics", pipeline="train", seed=5, epoch=0)
            assert sorted(e0) == list(range(len(paths)))
            assert all(v[0].shape == (3, 64, 64) for v in e0.values())
            again = epoch(c, "pics", pipeline="train", seed=5, epoch=0, batch_size=3)
            assert all(np.array_equal(e0[i][0], again[i][0]) for i in e0), "same seed and epoch, same bytes"
            e1 = epoch(c, "pics", pipeline="train", seed=5, epoch=1)
            assert sum(not np.array_equal(e0[i][0], e1[i][0]) for i in e0) == len(e0), "a new epoch, new crops"
            # Resumed mid-epoch on two ranks: the rest of the epoch, byte for byte.
            first = next(iter(c.stream("pics", 2, pipeline="train", seed=5, epoch=0)))
            rest = {}
            for rank in (0, 1):
                rest.update(epoch(c, "pics", pipeline="train", seed=5, epoch=0, batch_size=1,
                                  start_sample=first.resume_sample, rank=rank, world_size=2))
            assert sorted(list(rest) + [int(i) for i in first.sample_ids]) == sorted(e0)
            assert all(np.array_equal(e0[i][0], rest[i][0]) for i in rest)
            # Eval: the center 64x64 of the image resized to shorter side 96, as torchvision's
            # Resize(96) + CenterCrop(64) on the PIL image (the JPEG is decoded at half size
            # first, so pixels differ a little).
            ev = epoch(c, "pics", shuffle=False)
            assert all(np.array_equal(ev[i][0], epoch(c, "pics", seed=9, epoch=3)[i][0]) for i in ev), "no randomness"
            for i, p in enumerate(paths):
                img = Image.open(p).convert("RGB")
                w, h = img.size
                size = (96, int(96 * h / w)) if w <= h else (int(96 * w / h), 96)
                ref = np.asarray(img.resize(size, Image.BILINEAR)).transpose(2, 0, 1)
                y, x = round((size[1] - 64) / 2), round((size[0] - 64) / 2)
                ref = ref[:, y:y + 64, x:x + 64].astype(int)
                assert np.abs(ev[i][0].astype(int) - ref).mean() < 4, p.name
                assert ev[i][1] == (0 if p.parent.name == "a" else 1)
            # Train crops are other boxes of the same photo: about as bright, not the center.
            assert sum(not np.array_equal(e0[i][0], ev[i][0]) for i in ev) == len(ev)
            assert all(abs(e0[i][0].mean() - ev[i][0].mean()) < 60 for i in ev)
    finally:
        d.stop()


def test_an_augment_seed_draws_its_own_crops_over_the_same_order(tmp_path):
    """Jobs of a grid search on one order seed: the same samples in the same order, each job's
    crops from its own augment_seed; naming the order's seed changes nothing."""
    photos(tmp_path / "photos")
    d = images_daemon(tmp_path, tmp_path / "photos", TRAIN)
    try:
        with Client(d.unix) as c:
            def ordered(**kw):
                return [(int(i), np.array(b["image"][k])) for b in c.stream("pics", 2, pipeline="train", seed=5, **kw)
                        for k, i in enumerate(b.sample_ids)]
            plain, same, other = ordered(), ordered(augment_seed=5), ordered(augment_seed=6)
            assert [i for i, _ in plain] == [i for i, _ in same] == [i for i, _ in other], "one order"
            assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(plain, same)), "augment_seed = seed: as before"
            assert sum(not np.array_equal(a, b) for (_, a), (_, b) in zip(plain, other)) == len(plain)
    finally:
        d.stop()


def test_pipelines_a_dataset_lacks_are_refused_clearly(tmp_path):
    photos(tmp_path / "photos")
    d = images_daemon(tmp_path, tmp_path / "photos", "resize = 96\ncrop = 64\n")
    try:
        with Client(d.unix) as c:
            assert not c.dataset("pics").has_train_pipeline
            with pytest.raises(LarderError, match=r"no train pipeline.*\[dataset.train\]"):
                list(c.stream("pics", 2, pipeline="train"))
            with pytest.raises(ValueError, match="pipeline must be"):
                list(c.stream("pics", 2, pipeline="sideways"))
    finally:
        d.stop()


def test_the_cifar_recipe_on_hdf5_pads_crops_and_flips(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.integers(1, 256, (40, 3, 32, 32), dtype=np.uint8)  # no zeros: padding shows
    with h5py.File(tmp_path / "cifar.h5", "w") as f:
        f.create_dataset("images", data=x)
        f.create_dataset("labels", data=np.arange(40, dtype=np.int64) % 10)
    d = Daemon(tmp_path, f'[[dataset]]\nname = "cifar"\npath = "{tmp_path / "cifar.h5"}"\nlabels = "labels"\n'
                         '[dataset.train]\npadding = 4\n')
    try:
        with Client(d.unix) as c:
            ev = epoch(c, "cifar", batch_size=8)
            assert all(np.array_equal(ev[i][0], x[i]) for i in ev), "eval: as stored"
            offsets, flips = set(), 0
            for e in range(3):
                for i, (img, _) in epoch(c, "cifar", batch_size=8, pipeline="train", epoch=e).items():
                    found = _find_shift(x[i], img)
                    assert found is not None, f"sample {i} is no padded crop of its image"
                    offsets.add(found[:2])
                    flips += found[2]
            assert len(offsets) > 30 and all(abs(dx) <= 4 and abs(dy) <= 4 for dx, dy in offsets)
            assert 30 < flips < 90, f"{flips} of 120 flipped"
    finally:
        d.stop()


def _find_shift(orig, got):
    """(dx, dy, flipped) such that `got` is `orig` padded by 4 and cut at (dx, dy), then maybe
    mirrored; None if there is none."""
    padded = np.pad(orig, ((0, 0), (4, 4), (4, 4)))
    for flipped in (False, True):
        g = got[:, :, ::-1] if flipped else got
        for dy in range(-4, 5):
            for dx in range(-4, 5):
                if np.array_equal(padded[:, 4 + dy:36 + dy, 4 + dx:36 + dx], g):
                    return dx, dy, flipped
    return None


def test_bad_files_are_skipped_listed_and_counted(tmp_path):
    root = tmp_path / "photos"
    photos(root)
    (root / "a" / "fake.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    whole = PARROTS.read_bytes()
    (root / "b" / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    (root / "b" / "head.jpg").write_bytes(whole[:2000])
    d = images_daemon(tmp_path, root, TRAIN)
    try:
        with Client(d.unix) as c:
            n = c.dataset("pics").num_samples
            assert n == 9
            for e in range(2):
                got = epoch(c, "pics", batch_size=3, pipeline="train", epoch=e)
                assert len(got) == 6, "the six photos, each once; the three bad files left out"
            bad = c.bad_samples("pics")
            assert sorted(pathlib.Path(b.error.split("(")[1].split(")")[0]).name for b in bad) == ["cut.jpg", "fake.png", "head.jpg"]
            why = {pathlib.Path(b.error.split("(")[1].split(")")[0]).name: b.error for b in bad}
            assert "does not decode whole" in why["cut.jpg"], why
            assert "cut short" in why["head.jpg"], why
            assert c.stats().bad_samples == 3
            assert c.dataset("pics").bad_samples == 3
        # `larder warm` ends with the list.
        out = subprocess.run([str(larder_binary()), "--addr", d.unix, "warm", "pics"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "3 bad" in out.stdout and all(f in out.stdout for f in ("cut.jpg", "fake.png", "head.jpg")), out.stdout
    finally:
        d.stop()


def test_on_error_fail_ends_the_stream_naming_the_file(tmp_path):
    root = tmp_path / "photos"
    photos(root)
    (root / "b" / "cut.jpg").write_bytes(PARROTS.read_bytes()[:2000])
    d = images_daemon(tmp_path, root, 'on_error = "fail"\nresize = 96\ncrop = 64\n')
    try:
        with Client(d.unix) as c:
            with pytest.raises(LarderError, match="cut.jpg"):
                epoch(c, "pics")
    finally:
        d.stop()


def test_the_torch_dataset_asks_for_the_train_pipeline(tmp_path):
    torch = pytest.importorskip("torch")
    from larder.torch import LarderIterableDataset

    photos(tmp_path / "photos")
    d = images_daemon(tmp_path, tmp_path / "photos", TRAIN)
    try:
        ds = LarderIterableDataset("pics", 3, address=d.unix, seed=1, pipeline="train")
        loader = torch.utils.data.DataLoader(ds, batch_size=None)
        first = [x.clone() for x, _ in loader]
        second = [x.clone() for x, _ in loader]
        assert [x.shape for x in first] == [torch.Size([3, 3, 64, 64])] * 2
        assert not all(torch.equal(a, b) for a, b in zip(first, second)), "epoch 2 crops anew"
    finally:
        d.stop()


@pytest.mark.parametrize("interpolation,pil", [("linear", Image.BILINEAR), ("bicubic", Image.BICUBIC)])
def test_interpolation_and_crop_pct_resize_as_pil_and_timm_do(tmp_path, interpolation, pil):
    """`interpolation = "bicubic"` resamples as PIL's BICUBIC (timm's default), "linear" as
    BILINEAR; `crop_pct = 0.75` with crop 48 keeps the shorter side at floor(48 / 0.75) = 64."""
    root = tmp_path / "pics"
    (root / "a").mkdir(parents=True)
    src = Image.open(PARROTS).convert("RGB").crop((0, 0, 384, 256))
    src.save(root / "a" / "p.png")  # lossless: only the resampling differs
    d = images_daemon(tmp_path, root, f'crop = 48\ncrop_pct = 0.75\ninterpolation = "{interpolation}"\n')
    try:
        with Client(d.unix) as c:
            (img, _), = epoch(c, "pics", batch_size=1).values()
    finally:
        d.stop()
    assert img.shape == (3, 48, 48)
    kept = src.resize((96, 64), pil)  # the shorter side at 64
    want = np.asarray(kept)[8:56, 24:72].transpose(2, 0, 1)
    diff = np.abs(img.astype(int) - want.astype(int))
    assert diff.mean() < 1.5 and np.percentile(diff, 99) <= 8, (diff.mean(), np.percentile(diff, 99))
