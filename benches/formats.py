"""Cold epochs of the formats users keep their data in, larder against the format's own loader
in a torch DataLoader with 2 workers doing the same decode, taking turns, in one run:

- npy: `np.load(mmap_mode="r")` rows in a map-style Dataset, against larder's `kind = "npy"`;
- hf: `load_from_disk(...).with_transform(...)` decoding each JPEG (PIL, as `datasets` does),
  resizing the shorter side to 256 and cutting the 224 center (torchvision), against larder's
  `kind = "hf"` eval pipeline (resize 256, crop 224);
- parquet: the same images and labels as hub-style shards (`data/train-0000k-of-00002.parquet`,
  `to_parquet`), read by `pyarrow.parquet` as a careful user streams them: each worker takes its
  share of the row groups in a shuffled order, reads each once and yields its rows shuffled, with
  the same decode, against larder's `kind = "parquet"`;
- webdataset: the same images and labels as tar shards (`ShardWriter`, 150 a shard: 4 shards, a
  multiple of the 2 workers, so each reads as many), read by
  `webdataset.WebDataset(...).decode("pil")` with its own approximate shuffle (shards, then a
  buffer of 100) and the same resize and crop, against larder's `kind = "webdataset"`;
- lmdb: high- and low-resolution pairs (192 and 48 pixels a side, PNG level 1) in two LMDB
  environments as BasicSR's `make_lmdb_from_imgs` writes them, read by a BasicSR-style paired
  `Dataset` (LMDB get, cv2 decode, a random 128/32 crop at the same place and a flip, uint8)
  against larder's `kind = "lmdb"` train pipeline (the same crops and flips) through the Python
  client.

    PYTHONPATH=python .venv/bin/python benches/formats.py [--rounds 3] [--plot]

larder runs as the package ships it (as root: every dataset read by readers as nobody), with no
scratch tier and a memory tier of a few MB: every epoch is cold for it too. Each library loader is made once, with `persistent_workers=True`, and run one epoch before
the rounds (untimed), as larder's daemon is started before them: the rounds time epochs, not
worker start-up. Needs a built target/release/larderd and larder (or --debug), torch, torchvision and
datasets.
"""

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import results

REPO = pathlib.Path(__file__).resolve().parent.parent


KINDS = ("npy", "hf", "parquet", "webdataset", "lmdb")


def binary(name: str, debug: bool) -> str:
    path = REPO / "target" / ("debug" if debug else "release") / name
    if not path.exists():
        sys.exit(f"{path} is missing: cargo build {'' if debug else '--release '}first")
    return str(path)


def make_npy(root: pathlib.Path, n: int) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    np.save(root / "image.npy", rng.integers(0, 256, (n, 3, 64, 64), dtype=np.uint8))
    np.save(root / "label.npy", np.arange(n, dtype=np.int64) % 10)


def make_parquet(hf: pathlib.Path, root: pathlib.Path) -> None:
    import datasets

    ds = datasets.load_from_disk(str(hf))
    root.mkdir(parents=True)
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(str(root / f"train-0000{k}-of-00002.parquet"), batch_size=100)


def make_wds(hf: pathlib.Path, root: pathlib.Path) -> None:
    import datasets
    import webdataset as wds

    ds = datasets.load_from_disk(str(hf)).with_format("arrow")
    root.mkdir(parents=True)
    table = ds[:]
    images, labels = table["image"].to_pylist(), table["label"].to_pylist()
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=150, verbose=0) as sink:
        for i, (img, label) in enumerate(zip(images, labels)):
            sink.write({"__key__": f"s{i:06d}", "jpg": img["bytes"], "cls": label})


def make_lmdb(hf: pathlib.Path, root: pathlib.Path) -> None:
    """BasicSR-style pairs: 192-pixel crops of the hf images (PNG, level 1) and their 48-pixel
    bicubic reductions, in `gt.lmdb` and `lq.lmdb` with meta_info.txt."""
    import io

    import datasets
    import lmdb
    from PIL import Image

    ds = datasets.load_from_disk(str(hf)).with_format("arrow")
    root.mkdir(parents=True)
    images = ds[:]["image"].to_pylist()
    envs = {name: lmdb.open(str(root / f"{name}.lmdb"), map_size=1 << 30) for name in ("gt", "lq")}
    keys = []
    for i, img in enumerate(images):
        gt = Image.open(io.BytesIO(img["bytes"])).convert("RGB").crop((40, 40, 232, 232))
        for name, im in (("gt", gt), ("lq", gt.resize((48, 48), Image.BICUBIC))):
            buf = io.BytesIO()
            im.save(buf, format="PNG", compress_level=1)
            with envs[name].begin(write=True) as txn:
                txn.put(f"{i:04d}_s001".encode("ascii"), buf.getvalue())
        keys.append(f"{i:04d}_s001")
    for name, env in envs.items():
        env.close()
        size = 192 if name == "gt" else 48
        (root / f"{name}.lmdb" / "meta_info.txt").write_text("".join(f"{k}.png ({size},{size},3) 1\n" for k in keys))


class BasicSRPairs:
    """BasicSR's PairedImageDataset over LMDB, uint8: each worker opens the environments
    (readonly, no lock, no readahead, as its LmdbBackend does), gets both values by key, decodes
    them with cv2 and cuts a random 128 x 128 GT patch with its 32 x 32 LQ patch, flipped half
    of the time."""

    def __init__(self, root):
        self.root = root
        self.keys = [line.split(".")[0] for line in (root / "gt.lmdb" / "meta_info.txt").read_text().splitlines()]
        self.txns = None

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        import random

        import cv2
        import lmdb
        import torch

        if self.txns is None:
            self.txns = {name: lmdb.open(str(self.root / f"{name}.lmdb"), readonly=True, lock=False,
                                         readahead=False, meminit=False).begin(write=False) for name in ("gt", "lq")}
        key = self.keys[i].encode("ascii")
        img = {}
        for name, txn in self.txns.items():
            bgr = cv2.imdecode(np.frombuffer(txn.get(key), np.uint8), cv2.IMREAD_COLOR)
            img[name] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        top, left = random.randint(0, 48 - 32), random.randint(0, 48 - 32)
        lq = img["lq"][top:top + 32, left:left + 32]
        gt = img["gt"][top * 4:top * 4 + 128, left * 4:left * 4 + 128]
        if random.random() < 0.5:
            lq, gt = lq[:, ::-1], gt[:, ::-1]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))  # noqa: E731
        return {"gt": t(gt), "lq": t(lq)}


def lmdb_larder_epoch(socket: pathlib.Path, seed: int) -> float:
    """Samples/s of one train-pipeline epoch through the Python client."""
    sys.path.insert(0, str(REPO / "python"))
    import larder

    start, n = time.perf_counter(), 0
    with larder.Client(f"unix:{socket}") as c:
        for b in c.stream("lmdb", 32, pipeline="train", seed=seed):
            n += len(b.sample_ids)
    return n / (time.perf_counter() - start)


class ParquetStream(torch.utils.data.IterableDataset):
    """Rows of parquet shards as an IterableDataset over row groups: each DataLoader worker
    takes every num_workers-th row group of a per-epoch shuffled list, reads each once with
    pyarrow and yields its rows in a shuffled order, decoded as `datasets` would."""

    def __init__(self, folder):
        import pyarrow.parquet as pq

        self.paths = sorted(folder.glob("*.parquet"))
        self.groups = [(p, g) for p in self.paths for g in range(pq.ParquetFile(p).metadata.num_row_groups)]
        self.n = sum(pq.ParquetFile(p).metadata.num_rows for p in self.paths)
        self.epoch = 0

    def __len__(self):
        return self.n

    def __iter__(self):
        import io
        import random

        import pyarrow.parquet as pq
        import torch
        from PIL import Image

        info = torch.utils.data.get_worker_info()
        k, workers = (info.id, info.num_workers) if info else (0, 1)
        self.epoch += 1
        groups = list(self.groups)
        random.Random(self.epoch).shuffle(groups)
        files = {}
        for p, g in groups[k::workers]:
            f = files.setdefault(p, pq.ParquetFile(p))
            rows = f.read_row_group(g, columns=["image", "label"]).to_pylist()
            random.shuffle(rows)
            for row in rows:
                img = Image.open(io.BytesIO(row["image"]["bytes"]))
                yield hf_eval({"image": [img], "label": [row["label"]]})["image"][0], row["label"]


def make_hf(root: pathlib.Path, n: int) -> None:
    import io

    import datasets
    from PIL import Image

    rng = np.random.default_rng(1)
    images = []
    for i in range(n):
        y, x = np.mgrid[0:375, 0:500]
        base = (x * (i % 7 + 1) / 4 + y * (i % 5 + 1) / 3) % 256
        img = np.stack([base, base[::-1], base[:, ::-1]], -1) + rng.normal(0, 12, (375, 500, 3))
        buf = io.BytesIO()
        Image.fromarray(img.clip(0, 255).astype("uint8")).save(buf, format="JPEG", quality=90)
        images.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    ds = datasets.Dataset.from_dict({"image": images, "label": [i % 10 for i in range(n)]}, features=features)
    ds.save_to_disk(str(root))


class NpyRows:
    def __init__(self, folder):
        self.image = np.load(folder / "image.npy", mmap_mode="r")
        self.label = np.load(folder / "label.npy", mmap_mode="r")

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        import torch

        return torch.from_numpy(np.array(self.image[i])), int(self.label[i])


def hf_eval(batch):
    import torchvision.transforms as T

    t = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
    return {"image": [t(img.convert("RGB")) for img in batch["image"]], "label": batch["label"]}


LOADERS = {}


def library_loader(kind: str, path: pathlib.Path):
    """The library's own path in a DataLoader with 2 persistent workers, made once."""
    import torch

    if kind in LOADERS:
        return LOADERS[kind]
    keep = dict(num_workers=2, persistent_workers=True, batch_size=32)
    if kind == "webdataset":
        import torchvision.transforms as T
        import webdataset as wds

        t = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
        shards = sorted(str(p) for p in path.glob("*.tar"))
        ds = (wds.WebDataset(shards, shardshuffle=len(shards), nodesplitter=wds.split_by_node,
                             workersplitter=wds.split_by_worker, empty_check=False)
              .shuffle(100).decode("pil").to_tuple("jpg", "cls").map_tuple(lambda i: t(i.convert("RGB")), int))
        dl = torch.utils.data.DataLoader(ds, collate_fn=lambda rows: rows, **keep)
    elif kind == "lmdb":
        dl = torch.utils.data.DataLoader(BasicSRPairs(path), shuffle=True, **keep)
    elif kind == "npy":
        dl = torch.utils.data.DataLoader(NpyRows(path), shuffle=True, **keep)
    elif kind == "parquet":
        dl = torch.utils.data.DataLoader(ParquetStream(path), collate_fn=lambda rows: rows, **keep)
    else:
        import datasets

        ds = datasets.load_from_disk(str(path)).with_transform(hf_eval)
        dl = torch.utils.data.DataLoader(ds, shuffle=True, collate_fn=lambda rows: rows, **keep)
    LOADERS[kind] = dl
    return dl


def loader_epoch(kind: str, path: pathlib.Path) -> float:
    """Samples/s of one epoch through the library's own loader (made and warmed once)."""
    dl = library_loader(kind, path)
    start, n = time.perf_counter(), 0
    for b in dl:
        n += len(b["gt"]) if kind == "lmdb" else len(b[1]) if kind == "npy" else len(b)
    return n / (time.perf_counter() - start)


def larder_epoch(larder: str, socket: pathlib.Path, name: str) -> float:
    out = subprocess.run([larder, "--addr", f"unix:{socket}", "bench", name, "--epochs", "1",
                          "--clients", "1", "--batch-size", "32"], capture_output=True, text=True, timeout=900)
    m = re.search(r"epoch 0: \d+ samples in [\d.]+s = (\d+) samples/s", out.stdout)
    if out.returncode != 0 or not m:
        sys.exit(f"larder bench {name}: {out.stdout}{out.stderr}")
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=20000, help="rows of the npy arrays")
    p.add_argument("--images", type=int, default=600, help="JPEGs of the hf dataset")
    p.add_argument("--debug", action="store_true")
    results.add_options(p)
    args = p.parse_args()
    larderd, larder = binary("larderd", args.debug), binary("larder", args.debug)
    daemon = None
    runs = {(k, w): [] for k in KINDS for w in ("larder", "loader")}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        print(f"making {args.rows} npy rows and {args.images} JPEGs in a save_to_disk folder...", flush=True)
        make_npy(root / "npy", args.rows)
        make_hf(root / "hf", args.images)
        make_parquet(root / "hf", root / "parquet")
        make_wds(root / "hf", root / "webdataset")
        make_lmdb(root / "hf", root / "lmdb")
        socket = root / "larder.sock"
        config = root / "larder.toml"
        # As the package ships it where root can: the datasets read by readers (as nobody).
        readers = 'reader_user = "nobody"\n' if os.geteuid() == 0 else ""
        os.chmod(root, 0o755)
        config.write_text(
            f'unix_socket = "{socket}"\n{readers}[scratch]\nenabled = false\n[memory]\nbudget_bytes = 33554432\n'
            f'[[dataset]]\nname = "npy"\npath = "{root / "npy"}"\n'
            f'[[dataset]]\nname = "hf"\npath = "{root / "hf"}"\nresize = 256\ncrop = 224\n'
            f'[[dataset]]\nname = "parquet"\nkind = "parquet"\npath = "{root / "parquet"}"\n'
            f'resize = 256\ncrop = 224\n'
            f'[[dataset]]\nname = "webdataset"\nkind = "webdataset"\npath = "{root / "webdataset"}"\n'
            f'resize = 256\ncrop = 224\n'
            f'[[dataset.field]]\nname = "image"\next = "jpg"\n[[dataset.field]]\nname = "label"\next = "cls"\n'
            f'[[dataset]]\nname = "lmdb"\nkind = "lmdb"\npath = "{root / "lmdb"}"\nresize = 0\ncrop = 32\n'
            f'[[dataset.field]]\nname = "lq"\nlmdb = "lq.lmdb"\n'
            f'[[dataset.field]]\nname = "gt"\nlmdb = "gt.lmdb"\npair = {{ with = "lq", scale = 4 }}\n'
            f'[dataset.train]\n')
        try:
            daemon = subprocess.Popen([larderd, "--config", str(config)], stderr=subprocess.DEVNULL)
            deadline = time.time() + 60
            while not socket.exists():
                if time.time() > deadline or daemon.poll() is not None:
                    sys.exit("larderd did not start")
                time.sleep(0.05)
            time.sleep(1)
            for kind in KINDS:  # the loaders' workers started and warm, as the daemon is
                loader_epoch(kind, root / kind)
            for r in range(args.rounds):
                order = list(runs) if r % 2 == 0 else list(runs)[::-1]
                for kind, who in order:
                    path = root / kind
                    if who == "loader":
                        v = loader_epoch(kind, path)
                    elif kind == "lmdb":
                        v = lmdb_larder_epoch(socket, r)
                    else:
                        v = larder_epoch(larder, socket, kind)
                    runs[(kind, who)].append(v)
                print(f"round {r + 1}: " + ", ".join(f"{k}/{w} {v[-1]:.0f}/s" for (k, w), v in runs.items()),
                      flush=True)
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait()
    rows = []
    for kind in KINDS:
        a, b = statistics.median(runs[(kind, "larder")]), statistics.median(runs[(kind, "loader")])
        rows.append({"format": kind, "larder_per_s": a, "loader_per_s": b, "larder_vs_loader": a / b,
                     "larder_rounds": runs[(kind, "larder")], "loader_rounds": runs[(kind, "loader")]})
    print(f"\n{'format':<6} {'larder/s':>9} {'own loader/s':>13} {'ratio':>7}")
    for r in rows:
        print(f"{r['format']:<6} {r['larder_per_s']:>9.0f} {r['loader_per_s']:>13.0f} {r['larder_vs_loader']:>6.2f}x")
    results.save("formats", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
