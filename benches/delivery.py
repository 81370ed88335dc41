"""Side by side, in one run on the same files: how fast samples reach a training loop.

    PYTHONPATH=python .venv/bin/python benches/delivery.py [--larderd target/release/larderd]
        [--shapes 3x32x32,3x64x64,3x224x224] [--mb 300] [--epochs 2]

For each sample shape it writes one HDF5 file (uint8 images [N, ...] and int64 labels, about
--mb MB), then measures, with the data in the page cache and larder's memory tier warm:
  - baseline: what a careful user writes: a map-style torch Dataset over h5py (file opened once
    per worker, dataset handle kept, labels in memory), DataLoader(batch_size=128,
    shuffle=True, num_workers=2, persistent_workers=True);
  - larder Client.stream in one process (Unix socket);
  - larder LarderIterableDataset through DataLoader(num_workers=2);
  - memcpy: a single-thread copy of the same bytes, the ceiling of any delivery.
Each figure is samples/s over whole epochs (the best of --epochs); the table gives ratios to the
baseline of the same run, which hold on a shared machine where absolute figures drift.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import larder
from larder.torch import LarderIterableDataset

BATCH = 128


class H5Images(Dataset):
    """The careful baseline: one handle per worker, kept; labels in memory."""

    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as f:
            self.labels = f["labels"][()]
        self.images = None

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        if self.images is None:
            self.images = h5py.File(self.path, "r")["images"]
        return torch.from_numpy(self.images[i]), int(self.labels[i])


def timed_epochs(epochs, run_epoch):
    best = 0.0
    for e in range(epochs):
        t = time.perf_counter()
        n = run_epoch(e)
        best = max(best, n / (time.perf_counter() - t))
    return best


def touch(x):
    # The loop reads one byte of each batch, as a training step's transfer would start to.
    return int(x.reshape(-1)[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", "target/release/larderd"))
    p.add_argument("--shapes", default="3x32x32,3x64x64,3x224x224")
    p.add_argument("--mb", type=float, default=300)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="larder-bench-"))
    rows = []
    for spec in args.shapes.split(","):
        shape = tuple(int(d) for d in spec.split("x"))
        size = int(np.prod(shape))
        n = int(args.mb * 1e6 / size)
        path = tmp / f"{spec}.h5"
        rng = np.random.default_rng(0)
        with h5py.File(path, "w") as f:
            d = f.create_dataset("images", (n,) + shape, dtype=np.uint8)
            for s in range(0, n, 1000):
                d[s : s + 1000] = rng.integers(0, 256, (min(1000, n - s),) + shape, dtype=np.uint8)
            f["labels"] = np.arange(n, dtype=np.int64) % 1000
        config = tmp / f"{spec}.toml"
        sock = tmp / f"{spec}.sock"
        config.write_text(
            f'unix_socket = "{sock}"\n[scratch]\ndir = "{tmp / "scratch"}"\n[memory]\n'
            f"budget_bytes = {int(n * (size + 200) * 1.1)}\n"
            f'[[dataset]]\nname = "d"\npath = "{path}"\nlabels = "labels"\n'
        )
        log = open(tmp / f"{spec}.log", "wb")
        daemon = subprocess.Popen([args.larderd, "--config", str(config)], stderr=log)
        try:
            while not sock.exists():
                time.sleep(0.05)
            addr = f"unix:{sock}"
            # DataLoader workers first: gRPC is not fork-safe, so the parent opens no channel
            # before the workers are forked. The first epoch warms the memory tier.
            ds = LarderIterableDataset("d", BATCH, address=addr, seed=1)
            loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=False)

            def loader_epoch(e):
                ds.set_epoch(e)
                k = 0
                for images, labels in loader:
                    touch(images)
                    k += images.shape[0]
                return k

            workers = timed_epochs(args.epochs + 1, loader_epoch)
            with larder.Client(addr) as c:

                def stream_epoch(e):
                    k = 0
                    for b in c.stream("d", BATCH, seed=1, epoch=e):
                        images, labels = b.torch()
                        touch(images)
                        k += images.shape[0]
                    return k

                one_process = timed_epochs(args.epochs, stream_epoch)
        finally:
            daemon.terminate()
            daemon.wait()
        base = DataLoader(H5Images(path), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)

        def base_epoch(e):
            k = 0
            for images, labels in base:
                touch(images)
                k += images.shape[0]
            return k

        timed_epochs(1, base_epoch)  # page cache
        baseline = timed_epochs(args.epochs, base_epoch)
        src = np.random.default_rng(1).integers(0, 256, 256 << 20, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # fault the pages in first
        t = time.perf_counter()
        for _ in range(4):
            np.copyto(dst, src)
        memcpy = 4 * src.nbytes / (time.perf_counter() - t) / size
        rows.append((spec, baseline, one_process, workers, memcpy, size))
        path.unlink()
    print(f"\n{'samples':<10} {'baseline h5py DataLoader':>26} {'larder Client.stream':>24} {'larder DataLoader x2':>24} {'memcpy 1 thread':>20}")
    for spec, baseline, one, workers, memcpy, size in rows:
        def cell(v):
            return f"{v:,.0f}/s {v * size / 1e9:.2f}GB/s {v / baseline:.2f}x"
        print(f"{spec:<10} {cell(baseline):>26} {cell(one):>24} {cell(workers):>24} {cell(memcpy):>20}")


if __name__ == "__main__":
    sys.exit(main())
