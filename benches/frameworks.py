"""Which Accelerate setup is fastest: two processes on one dataset, in one run.

    PYTHONPATH=python .venv/bin/python benches/frameworks.py [--larderd target/release/larderd]
        [--shape 3x64x64] [--mb 250] [--epochs 3] [--out benches/results] [--plot]
    PYTHONPATH=python .venv/bin/python benches/frameworks.py --mb 5 --epochs 1   (smoke)

Writes one HDF5 file (uint8 images, int64 labels), starts larderd on it, and runs under torchrun
(2 processes, CPU, gloo), each loop touching every batch as a training step would:
  - plain DDP: DataLoader(LarderIterableDataset(...), batch_size=None), no Accelerate;
  - accelerate, loader not prepared: accelerator.prepare(model, optimizer) only, each process
    streaming its own shard (docs/users.md's Accelerate example);
  - accelerate, prepared (its defaults): process 0 streams every batch and Accelerate sends each
    process its part (dispatch_batches).
Each figure is samples/s across both processes, the median of --epochs epochs after one that
warms larder's memory tier.

The figures go to --out (see benches/results.py): frameworks.json and frameworks.csv, a row per
setup (samples/s and the ratio to plain DDP); --plot draws the PNG: samples/s per setup.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import results  # noqa: E402
from delivery import write_images  # noqa: E402

BATCH = 128


def inner(mode: str, address: str, epochs: int) -> None:
    """One of the two processes torchrun starts."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from larder.torch import LarderIterableDataset

    loader = DataLoader(LarderIterableDataset("d", BATCH, address=address, seed=1), batch_size=None)
    model = torch.nn.Linear(4, 4)
    if mode == "plain":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        barrier = dist.barrier
    else:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        if mode == "prepared":
            model, loader = acc.prepare(model, loader)
        else:
            model = acc.prepare(model)
        rank, barrier = acc.process_index, acc.wait_for_everyone
    rates = []
    for epoch in range(epochs + 1):
        barrier()
        started, seen = time.perf_counter(), torch.zeros(1, dtype=torch.int64)
        for images, labels in loader:
            images.reshape(-1)[:: 4096].sum()  # touch the batch
            seen += len(labels)
        barrier()
        dist_seen = seen.clone()
        torch.distributed.all_reduce(dist_seen)
        if epoch > 0:  # the first warms the memory tier
            rates.append(int(dist_seen) / (time.perf_counter() - started))
    if rank == 0:
        print(f"RESULT {statistics.median(rates):.0f}", flush=True)
    barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", "target/release/larderd"))
    p.add_argument("--shape", default="3x64x64")
    p.add_argument("--mb", type=float, default=250)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--inner", nargs=2, metavar=("MODE", "ADDRESS"), help=argparse.SUPPRESS)
    results.add_options(p)
    args = p.parse_args()
    if args.inner:
        inner(args.inner[0], args.inner[1], args.epochs)
        return
    shape = tuple(int(d) for d in args.shape.split("x"))
    n = int(args.mb * 1e6 / np.prod(shape))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        path = write_images(tmp / "d.h5", n, shape)
        sock, config = tmp / "d.sock", tmp / "d.toml"
        config.write_text(
            f'unix_socket = "{sock}"\n[scratch]\ndir = "{tmp / "scratch"}"\n[memory]\n'
            # The file, the rings the runs open (they count in the budget): two of ten slots, and
            # the message path's share (256 MiB).
            f"budget_bytes = {int(n * (np.prod(shape) + 200) * 1.25) + 2 * 10 * (BATCH * (int(np.prod(shape)) + 8) + 8192) + (256 << 20)}\n"
            f"message_bytes = {256 << 20}\n"
            f'[[dataset]]\nname = "d"\ntcp = true\npath = "{path}"\nlabels = "labels"\n'
        )
        daemon = subprocess.Popen([args.larderd, "--config", str(config)], stderr=open(tmp / "log", "wb"))
        try:
            while not sock.exists():
                time.sleep(0.05)
            print(f"{n} samples of {args.shape}, batch {BATCH}, 2 processes, samples/s across both")
            rows = {}
            for mode, label in [("plain", "plain DDP (no Accelerate)"),
                                ("unprepared", "accelerate, loader not prepared"),
                                ("prepared", "accelerate, loader prepared (defaults)")]:
                out = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     __file__, "--epochs", str(args.epochs), "--inner", mode, f"unix:{sock}"],
                    capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                found = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
                if not found:
                    sys.exit(out.stderr[-3000:])
                rows[label] = float(found[0].split()[1])
            base = rows["plain DDP (no Accelerate)"]
            print("| setup | samples/s | vs plain DDP |\n|---|---|---|")
            for label, rate in rows.items():
                print(f"| {label} | {rate:,.0f} | {rate / base:.2f}x |")
            results.save("frameworks", args, [{"setup": label, "samples_per_s": rate, "ratio": rate / base}
                                              for label, rate in rows.items()], samples=n)
        finally:
            daemon.terminate()
            daemon.wait()


if __name__ == "__main__":
    main()
