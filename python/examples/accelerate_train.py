"""Trains a small CNN with Hugging Face Accelerate on a dataset served by larderd.

    accelerate launch --num_processes 2 examples/accelerate_train.py --address unix:/run/larder/larder.sock --dataset cifar10-train

The DataLoader stays out of accelerator.prepare(): each process streams its own shard of every
epoch from the daemon, every process the same number of batches. (Prepared with Accelerate's
defaults it works too, but process 0 then reads every batch and sends each process its part.)
"""

import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader

import larder
from larder.torch import LarderIterableDataset, to_float


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="larderd address (default: $LARDER_ADDR)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    accelerator = Accelerator()
    with larder.Client(args.address) as client:
        channels = next(f for f in client.dataset(args.dataset).fields if f.name == "image").shape[0]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4, args.classes),
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)
    ds = LarderIterableDataset(args.dataset, args.batch_size, address=args.address,
                               pin_memory=accelerator.device.type == "cuda")
    loader = DataLoader(ds, batch_size=None, num_workers=0)
    for epoch in range(args.epochs):
        seen = correct = 0
        for images, labels in loader:  # each iteration of the loader is the next epoch
            logits = model(to_float(images, accelerator.device))
            labels = labels.to(accelerator.device, non_blocking=True)
            loss = nn.functional.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            opt.step()
            seen += len(labels)
            correct += int((logits.argmax(1) == labels).sum())
        print(f"epoch {epoch} rank {accelerator.process_index}: accuracy "
              f"{correct / max(seen, 1):.3f} ({seen} samples)", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
