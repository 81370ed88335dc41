"""Side by side, in one run on the same files: how fast samples reach a training loop.

    PYTHONPATH=python .venv/bin/python benches/delivery.py [--larderd target/release/larderd]
        [--shapes 3x32x32,3x64x64,3x224x224] [--mb 300] [--epochs 3] [--oom-mb MB]
        [--out benches/results] [--plot]
    PYTHONPATH=python .venv/bin/python benches/delivery.py --shapes 3x32x32 --mb 5 --epochs 1   (smoke)

For each sample shape it writes one HDF5 file (uint8 images [N, ...] and int64 labels, about
--mb MB), then measures, with the data in the page cache and larder's memory tier warm:
  - baseline: what a careful user writes: a map-style torch Dataset over h5py (file opened once
    per worker, dataset handle kept, labels in memory), DataLoader(batch_size=128,
    shuffle=True, num_workers=2, persistent_workers=True);
  - larder bytes: Client.stream(transport="bytes"), batches in the gRPC messages (the path of
    TCP and remote clients), one process; once as the client was before shared memory (the
    generated stub, protobuf parsing whole messages, no read-ahead) and once as it is;
  - larder shm: Client.stream(transport="shm"), batches in shared memory, one process;
  - larder torch (the recommended setup): DataLoader(LarderIterableDataset(...),
    batch_size=None, num_workers=0), shared memory and a prefetch thread;
  - larder.torch.DataLoader: a port that keeps its script's DataLoader arguments, as the
    three-line port of pytorch/examples' main.py does (DataLoader(ds, batch_size=128,
    shuffle=True, num_workers=4, pin_memory=True, persistent_workers=True) after
    `from larder.torch import datasets, DataLoader`), which starts no workers;
  - larder torch x2: the same dataset through DataLoader(num_workers=2) (workers pickle every
    batch to the training process);
  - memcpy: a single-thread copy of the same bytes, the ceiling of any delivery.
Each figure is samples/s over a whole epoch, the median of --epochs epochs; the table gives
ratios to the baseline of the same run, which hold on a shared machine where absolute figures
drift.

--oom-mb MB (root, cgroup v1 or v2 memory controller) adds the case of a dataset that does not
fit in memory (the seed notes' 13 GB set on a 16 GB machine, scaled down): a 3x64x64 file of that
size, the page cache dropped before each run; the baseline runs in a memory cgroup of half the
dataset plus 1 GB for Python, torch and its two workers; larderd and the training process
together in one of the same size, larderd with a memory tier of 80% of the half.

The figures go to --out (see benches/results.py): delivery.json and delivery.csv, a row per
shape (each setup's samples/s, GB/s and ratio to the baseline); --plot draws delivery.png, each
shape's samples/s per setup, log scale. The --oom-mb case goes to delivery-oom.json, .csv and
.png (both setups' samples/s), so a run of it alone (--shapes "") leaves the shapes' files be.
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

import grpc

import larder
import results
from larder.torch import LarderIterableDataset
from larder.torch import DataLoader as LarderDataLoader
from larder.v1 import larder_pb2 as pb
from larder.v1.larder_pb2_grpc import LarderStub

BATCH = 128
# The table's columns: the key of each setup in the results' rows, and its heading.
SETUPS = [
    ("baseline", "baseline h5py DataLoader x2"),
    ("bytes_before", "larder bytes, the client before"),
    ("bytes", "larder bytes"),
    ("shm", "larder shm"),
    ("recommended", "larder torch (recommended)"),
    ("port", "larder.torch.DataLoader, a port's 4 workers"),
    ("workers2", "larder torch x2 workers"),
    ("memcpy", "memcpy 1 thread"),
]


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


# The message path's share of the daemon's memory budget (held back from the memory tier).
MESSAGE_BYTES = 256 << 20

def timed_epochs(epochs, run_epoch):
    """The median rate, samples/s, of `epochs` epochs."""
    rates = []
    for e in range(epochs):
        t = time.perf_counter()
        n = run_epoch(e)
        rates.append(n / (time.perf_counter() - t))
    return float(np.median(rates))


def write_images(path, n, shape):
    """An HDF5 file of n random uint8 images of `shape` and int64 labels; returns its path."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("images", (n,) + shape, dtype=np.uint8)
        for s in range(0, n, 1000):
            d[s : s + 1000] = rng.integers(0, 256, (min(1000, n - s),) + shape, dtype=np.uint8)
        f["labels"] = np.arange(n, dtype=np.int64) % 1000
    return path


def counted(batches_of):
    """An epoch function: iterates `batches_of(epoch)` (pairs of images, labels), touching each
    batch as a training step would, and returns the samples seen."""

    def run(e):
        k = 0
        for images, labels in batches_of(e):
            touch(images)
            k += images.shape[0]
        return k

    return run


def touch(x):
    # The loop reads one byte of each batch, as a training step's transfer would start to.
    return int(x.reshape(-1)[0])


CGROUP_V1 = pathlib.Path("/sys/fs/cgroup/memory")
CGROUP_V2 = pathlib.Path("/sys/fs/cgroup")


def make_cgroup(name, limit):
    """A memory cgroup of `limit` bytes; returns the file a pid is written to to join it."""
    if (CGROUP_V1 / "memory.limit_in_bytes").exists():
        d = CGROUP_V1 / name
        d.mkdir(exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(str(limit))
    else:
        d = CGROUP_V2 / name
        d.mkdir(exist_ok=True)
        (d / "memory.max").write_text(str(limit))
    return d / "cgroup.procs"


def in_cgroup(procs, argv):
    """argv, started inside the cgroup whose procs file is `procs`."""
    return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"] + [str(a) for a in argv]


def drop_page_cache():
    subprocess.run(["sync"], check=True)
    pathlib.Path("/proc/sys/vm/drop_caches").write_text("1")


def baseline_only(path, epochs):
    """Runs the baseline on `path` and prints its median rate (for a run inside a cgroup)."""
    base = DataLoader(H5Images(path), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)

    print(timed_epochs(epochs, counted(lambda e: base)))


def larder_only(address, epochs):
    """Runs the recommended setup against `address` (the first epoch warms) and prints its median
    rate and the memory-tier hit rate (for a run inside a cgroup)."""
    ds = LarderIterableDataset("d", BATCH, address=address, seed=1)
    epoch = counted(lambda e: DataLoader(ds, batch_size=None, num_workers=0))
    timed_epochs(1, epoch)
    rate = timed_epochs(epochs, epoch)
    with larder.Client(address) as c:
        print(rate, c.stats().hit_rate)


def out_of_memory(args, tmp):
    """Baseline vs larder's recommended setup on a dataset twice the memory each may use."""
    shape = (3, 64, 64)
    size = int(np.prod(shape))
    n = int(args.oom_mb * 1e6 / size)
    path = write_images(tmp / "oom.h5", n, shape)
    half = int(args.oom_mb * 1e6 / 2)
    limit = half + (1 << 30)  # half the dataset, and 1 GB for Python, torch and the workers
    env = {**os.environ, "PYTHONPATH": "python"}
    drop_page_cache()
    procs = make_cgroup("larder-bench-baseline", limit)
    out = subprocess.run(
        in_cgroup(procs, [sys.executable, __file__, "--baseline-only", path, "--epochs", args.epochs]),
        capture_output=True, text=True, check=True, env=env,
    )
    baseline = float(out.stdout.strip().splitlines()[-1])
    # larderd and the training process together in a cgroup of the same size.
    drop_page_cache()
    procs = make_cgroup("larder-bench-larder", limit)
    sock = tmp / "oom.sock"
    config = tmp / "oom.toml"
    config.write_text(
        f'unix_socket = "{sock}"\n[scratch]\ndir = "{tmp / "oom-scratch"}"\n[memory]\n'
        f"budget_bytes = {int(half * 0.8)}\n"
        f'[[dataset]]\nname = "d"\ntcp = true\npath = "{path}"\nlabels = "labels"\n'
    )
    daemon = subprocess.Popen(in_cgroup(procs, [args.larderd, "--config", config]),
                              stderr=open(tmp / "oom.log", "wb"))
    try:
        while not sock.exists():
            time.sleep(0.05)
        out = subprocess.run(
            in_cgroup(procs, [sys.executable, __file__, "--larder-only", f"unix:{sock}", "--epochs", args.epochs]),
            capture_output=True, text=True, check=True, env=env,
        )
        larder_rate, hit_rate = (float(x) for x in out.stdout.strip().splitlines()[-1].split())
    finally:
        daemon.terminate()
        daemon.wait()
        path.unlink()
    print(f"\nA dataset that does not fit: 3x64x64, {args.oom_mb:.0f} MB; the baseline, and larderd with "
          f"the training process, each in a memory cgroup of {limit / 1e6:.0f} MB (half the dataset and "
          "1 GB); page cache dropped first")
    print("| samples | baseline h5py DataLoader x2 | larder torch (recommended) |")
    print("|---|---|---|")
    print(f"| 3x64x64, {args.oom_mb:.0f} MB | {baseline:,.0f}/s {baseline * size / 1e9:.2f} GB/s **1.00x** | "
          f"{larder_rate:,.0f}/s {larder_rate * size / 1e9:.2f} GB/s **{larder_rate / baseline:.2f}x** "
          f"(memory-tier hit rate {hit_rate:.0%}) |")
    return {"shape": "3x64x64", "mb": args.oom_mb, "cgroup_mb": limit / 1e6, "sample_bytes": size,
            "baseline_per_s": baseline, "baseline_gb_per_s": baseline * size / 1e9,
            "larder_per_s": larder_rate, "larder_gb_per_s": larder_rate * size / 1e9,
            "larder_ratio": larder_rate / baseline, "memory_tier_hit_rate": hit_rate}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", "target/release/larderd"))
    p.add_argument("--shapes", default="3x32x32,3x64x64,3x224x224")
    p.add_argument("--mb", type=float, default=300)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--oom-mb", type=float, default=0, help="add the dataset-larger-than-memory case")
    p.add_argument("--baseline-only", help=argparse.SUPPRESS)
    p.add_argument("--larder-only", help=argparse.SUPPRESS)
    results.add_options(p)
    args = p.parse_args()
    if args.baseline_only:
        return baseline_only(args.baseline_only, args.epochs)
    if args.larder_only:
        return larder_only(args.larder_only, args.epochs)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="larder-bench-"))
    if args.oom_mb:
        results.save("delivery", args, [out_of_memory(args, tmp)], name="delivery-oom")
        if not args.shapes:
            return
    rows = []
    for spec in args.shapes.split(","):
        shape = tuple(int(d) for d in spec.split("x"))
        size = int(np.prod(shape))
        n = int(args.mb * 1e6 / size)
        path = write_images(tmp / f"{spec}.h5", n, shape)
        config = tmp / f"{spec}.toml"
        sock = tmp / f"{spec}.sock"
        # The whole file in memory, and room for the shared-memory rings the runs open (their
        # bytes come off the memory tier's budget): two of ten slots of a batch each; and the
        # message path's share (MESSAGE_BYTES), which the daemon holds back from the tier.
        rings = 2 * 10 * (BATCH * (size + 8) + 8192) + MESSAGE_BYTES
        config.write_text(
            f'unix_socket = "{sock}"\n[scratch]\ndir = "{tmp / "scratch"}"\n[memory]\n'
            f"budget_bytes = {int(n * (size + 200) * 1.25) + rings}\nmessage_bytes = {MESSAGE_BYTES}\n"
            f'[[dataset]]\nname = "d"\ntcp = true\npath = "{path}"\nlabels = "labels"\n'
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

            loader_epoch = counted(lambda e: loader)  # each pass is the next epoch
            timed_epochs(1, loader_epoch)  # warms the memory tier
            workers = timed_epochs(args.epochs, loader_epoch)
            del loader
            with larder.Client(addr) as c:

                def stream_epoch(transport, prefetch=2):
                    return counted(lambda e: (b.torch() for b in c.stream(
                        "d", BATCH, seed=1, epoch=e, transport=transport, prefetch=prefetch)))

                # The bytes path as the client had it before shared memory: the generated stub,
                # protobuf parsing the whole message, no read-ahead, default HTTP/2 settings.
                old = grpc.insecure_channel(addr, options=[
                    ("grpc.max_receive_message_length", -1), ("grpc.default_authority", "localhost")])
                stub = LarderStub(old)

                def before(e):
                    req = pb.StreamBatchesRequest(dataset="d", batch_size=BATCH, seed=1, epoch=e, layout_version=1)
                    return (larder.Batch(m).torch() for m in stub.StreamBatches(req))

                by_bytes_before = timed_epochs(args.epochs, counted(before))
                old.close()
                by_bytes = timed_epochs(args.epochs, stream_epoch("bytes"))
                by_shm = timed_epochs(args.epochs, stream_epoch("shm"))
                stats = c.stats()
                assert stats.shm_batches > 0, "the shm path was used"
            torch_ds = LarderIterableDataset("d", BATCH, address=addr, seed=1)
            torch_loader = DataLoader(torch_ds, batch_size=None, num_workers=0)

            recommended = timed_epochs(args.epochs, counted(lambda e: torch_loader))
            # A port that keeps the script's DataLoader arguments: larder.torch.DataLoader with 4
            # workers, shuffle and pinned memory asked for (it starts no workers).
            port_ds = LarderIterableDataset("d", BATCH, address=addr, seed=1)
            port = LarderDataLoader(port_ds, batch_size=BATCH, shuffle=True, num_workers=4, pin_memory=True,
                                    persistent_workers=True)
            ported = timed_epochs(args.epochs, counted(lambda e: port))
        finally:
            daemon.terminate()
            daemon.wait()
        base = DataLoader(H5Images(path), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)

        base_epoch = counted(lambda e: base)
        timed_epochs(1, base_epoch)  # page cache
        baseline = timed_epochs(args.epochs, base_epoch)
        src = np.random.default_rng(1).integers(0, 256, 256 << 20, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # fault the pages in first
        t = time.perf_counter()
        for _ in range(4):
            np.copyto(dst, src)
        memcpy = 4 * src.nbytes / (time.perf_counter() - t) / size
        rows.append((spec, size, [baseline, by_bytes_before, by_bytes, by_shm, recommended, ported, workers,
                                  memcpy]))
        path.unlink()
    names = [label for _, label in SETUPS]
    print("\nsamples/s, GB/s, and the ratio to the baseline of the same run (median of "
          f"{args.epochs} epochs each)")
    print("| samples | " + " | ".join(names) + " | recommended / memcpy |")
    print("|---" * (len(names) + 2) + "|")
    for spec, size, rates in rows:
        base, memcpy = rates[0], rates[-1]
        cells = [f"{v:,.0f}/s {v * size / 1e9:.2f} GB/s **{v / base:.2f}x**" for v in rates]
        print(f"| {spec} | " + " | ".join(cells) + f" | {rates[4] / memcpy:.0%} |")
    table = []
    for spec, size, rates in rows:
        row = {"shape": spec, "sample_bytes": size}
        for (key, _), v in zip(SETUPS, rates):
            row.update({f"{key}_per_s": v, f"{key}_gb_per_s": v * size / 1e9, f"{key}_ratio": v / rates[0]})
        row["recommended_over_memcpy"] = rates[4] / rates[-1]
        table.append(row)
    results.save("delivery", args, table, labels=dict(SETUPS))


if __name__ == "__main__":
    sys.exit(main())
