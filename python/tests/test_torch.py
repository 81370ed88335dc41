"""The torch IterableDataset: DataLoader workers x DDP ranks, exactly once, resume, training."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import REPO, Daemon, make_h5
from larder.torch import LarderIterableDataset, resume_points, shard_batches


def ids_of(loader):
    """Sample ids in the order the loader yields them, read back from the pixel data."""
    out = []
    for images, labels in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (2, 4, 4)
        # Pixel 0 of sample i is (i * 131) % 251, and its label i % 10: enough to recover i < 300.
        for img, label in zip(images, labels):
            first = int(img.reshape(-1)[0])
            candidates = [i for i in range(300) if (i * 131) % 251 == first and i % 10 == label]
            assert len(candidates) == 1
            out.append(candidates[0])
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_and_ranks_cover_the_epoch_exactly_once(daemon, workers):
    seen = []
    for rank in range(2):
        ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=5, rank=rank, world_size=2)
        ds.set_epoch(3)
        seen += ids_of(DataLoader(ds, batch_size=None, num_workers=workers))
    assert sorted(seen) == list(range(300))


def test_resuming_mid_epoch_with_workers(daemon):
    ds = LarderIterableDataset("train", 7, address=daemon.unix, seed=1)
    full = ids_of(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(full) == list(range(300))
    # Stop after 21 batches, as a checkpoint would; resume from step 21 (worker 1's turn).
    ds.set_epoch(0)  # iterated again, it would serve the next epoch
    first = []
    for step, (images, labels) in enumerate(DataLoader(ds, batch_size=None, num_workers=2)):
        if step == 21:
            break
        first.append((images, labels))
    resumed = LarderIterableDataset("train", 7, address=daemon.unix, seed=1, start_step=21)
    rest = ids_of(DataLoader(resumed, batch_size=None, num_workers=2))
    together = ids_of(first) + rest
    assert sorted(together) == list(range(300)), "nothing lost, nothing twice"
    assert together == full, "and in the same order as the uninterrupted epoch"


def epochs_of(ds, loader, n):
    """The orders of n epochs, each checked to be every sample exactly once."""
    orders = []
    for _ in range(n):
        ids = ids_of(loader)
        assert sorted(ids) == list(range(300)), "every sample exactly once per epoch"
        orders.append(ids)
    return orders


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_iterating_again_is_the_next_epoch(daemon, workers, persistent):
    # Nobody calls set_epoch (as Lightning does not for an IterableDataset).
    ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent)
    orders = epochs_of(ds, loader, 3)
    assert orders[0] != orders[1] != orders[2] != orders[0], "a new order every epoch"
    # The same epochs, asked for explicitly, give the same orders: set_epoch wins.
    again = LarderIterableDataset("train", 8, address=daemon.unix, seed=4)
    again_loader = DataLoader(again, batch_size=None, num_workers=workers, persistent_workers=persistent)
    again.set_epoch(1)
    assert ids_of(again_loader) == orders[1]
    assert ids_of(again_loader) == orders[2], "and the next iteration goes on from it"
    again.set_epoch(0)
    assert ids_of(again_loader) == orders[0], "set_epoch reaches persistent workers too"


def test_resume_points_follow_the_loaders_round_robin():
    assert resume_points(5, [3, 3]) == ([3, 2], 1)
    assert resume_points(5, [2, 4]) == ([2, 3], 0), "a worker that ran out is skipped"
    assert resume_points(99, [1, 1]) == ([1, 1], 0)
    assert shard_batches(300, 7, 0, 3, False) == 15 and shard_batches(301, 7, 1, 3, False) == 15
    assert shard_batches(10, 4, 0, 1, True) == 2


def quadrant_daemon(tmp_path, n: int) -> Daemon:
    """larderd serving "quad", a learnable set: the class decides which quadrant is bright."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, n)
    images = rng.integers(0, 60, (n, 3, 16, 16), dtype=np.uint8)
    for i, c in enumerate(labels):
        y, x = divmod(int(c), 2)
        images[i, :, y * 8 : y * 8 + 8, x * 8 : x * 8 + 8] += 150
    import h5py

    with h5py.File(tmp_path / "quad.h5", "w") as f:
        f.create_dataset("images", data=images)
        f.create_dataset("labels", data=labels.astype(np.int64))
    return Daemon(tmp_path, f'[[dataset]]\nname = "quad"\npath = "{tmp_path / "quad.h5"}"\nlabels = "labels"\n')


def run_example(launcher: list, address: str, epochs: int) -> subprocess.CompletedProcess:
    d_args = ["--address", address, "--dataset", "quad", "--epochs", str(epochs), "--batch-size", "32",
              "--workers", "2", "--classes", "4"]
    return subprocess.run(launcher + [str(REPO / "python" / "examples" / "train.py")] + d_args,
                          capture_output=True, text=True, timeout=300)


def test_example_training_script_learns(tmp_path):
    d = quadrant_daemon(tmp_path, 512)
    try:
        out = run_example([sys.executable], d.unix, epochs=3)
    finally:
        d.stop()
    assert out.returncode == 0, out.stderr
    last = [l for l in out.stdout.splitlines() if l.startswith("epoch 2")]
    assert last, out.stdout
    accuracy = float(last[0].split("accuracy ")[1].split()[0])
    assert accuracy > 0.9, out.stdout
    assert "larderd memory hit rate" in out.stdout


def test_example_under_torchrun_with_uneven_ranks(tmp_path):
    # 513 samples on 2 ranks: 257 (9 batches of 32) and 256 (8 batches). Without DDP's join the
    # rank with fewer batches leaves, and the other fails in its next gradient sync.
    d = quadrant_daemon(tmp_path, 513)
    try:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        out = run_example(torchrun, d.unix, epochs=2)
    finally:
        d.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    # The ranks' lines can interleave on the shared stdout.
    lines = re.findall(r"epoch (\d+): loss \S+ accuracy \S+ \((\d+) samples", out.stdout)
    for epoch in range(2):
        assert sorted(int(n) for e, n in lines if e == str(epoch)) == [256, 257], out.stdout


def _ddp_rank(rank, world, port, address, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = LarderIterableDataset("train", 16, address=address, seed=9)  # rank from the process group
        ids = ids_of(DataLoader(ds, batch_size=None, num_workers=2))
        (pathlib.Path(out_dir) / f"rank{rank}.txt").write_text(" ".join(map(str, ids)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_from_a_real_process_group(daemon, tmp_path):
    import torch.multiprocessing as mp
    from conftest import free_port

    mp.spawn(_ddp_rank, args=(2, free_port(), daemon.unix, str(tmp_path)), nprocs=2, join=True)
    shards = [list(map(int, (tmp_path / f"rank{r}.txt").read_text().split())) for r in range(2)]
    assert all(len(s) == 150 for s in shards)
    assert sorted(shards[0] + shards[1]) == list(range(300)), "each sample on exactly one rank"
