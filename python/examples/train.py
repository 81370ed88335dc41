"""Trains a small CNN on a dataset served by larderd.

    python examples/train.py --address unix:/run/larder/larder.sock --dataset cifar10-train

The daemon shuffles, shards and batches; batches of uint8 images arrive in shared memory and
are converted to float on the training device. Works under torchrun too: each DDP rank streams
its own shard, all ranks the same number of batches.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

import larder
from larder.torch import LarderIterableDataset, to_float


def model_for(channels: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4, classes),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="larderd address (default: $LARDER_ADDR)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (0 is fastest)")
    p.add_argument("--channels", type=int, default=3, help="channels of the image field")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    if "RANK" in os.environ and not dist.is_initialized():  # started by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    # No larder.Client calls here before DataLoader workers start: a process that has used gRPC
    # cannot fork them safely. (`larder datasets` lists each dataset's fields and shapes.)
    model = model_for(args.channels, args.classes).to(device)
    if dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    # The daemon batches, and with num_workers=0 (the fastest setup) batches arrive in shared
    # memory, read ahead by a background thread; pin_memory registers that memory with CUDA.
    ds = LarderIterableDataset(args.dataset, args.batch_size, address=args.address, seed=args.seed,
                               pin_memory=device.type == "cuda")
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers)
    for epoch in range(args.epochs):
        started = time.perf_counter()
        seen = correct = 0
        total_loss = 0.0
        # Each iteration of the loader is the next epoch (no set_epoch needed), and every rank
        # gets the same number of batches (even_batches), so a plain DDP loop never hangs.
        for images, labels in loader:
            x = to_float(images, device)
            y = labels.to(device, non_blocking=True)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(y)
            correct += (logits.argmax(1) == y).sum().item()
            total_loss += loss.item() * len(y)
        secs = time.perf_counter() - started
        print(f"epoch {epoch}: loss {total_loss / max(seen, 1):.4f} accuracy {correct / max(seen, 1):.3f} "
              f"({seen} samples, {seen / secs:.0f} samples/s)", flush=True)

    with larder.Client(args.address) as client:
        s = client.stats()
    print(f"larderd memory hit rate {s.hit_rate:.1%}, client stall {s.client_stall_seconds:.2f}s")


if __name__ == "__main__":
    main()
