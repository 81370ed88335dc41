"""Accelerate, as its docs show: accelerator.prepare(model, optimizer, dataloader) with its
defaults. Records the ids each process trains on, per epoch.

    torchrun --nproc_per_node 2 accelerate_fit.py ADDRESS OUT --workers K --epochs E [--no-prepare]
"""

import argparse
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Recorder  # noqa: E402

from larder.torch import LarderIterableDataset  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--no-prepare", action="store_true", help="keep the DataLoader out of prepare()")
    p.add_argument("--dispatch-batches", choices=["default", "false"], default="default")
    a = p.parse_args()
    config = DataLoaderConfiguration(dispatch_batches=False if a.dispatch_batches == "false" else None)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    record = Recorder(a.out, accelerator.process_index)
    model = torch.nn.Linear(32, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(LarderIterableDataset("train", 10, address=a.address, seed=3),
                        batch_size=None, num_workers=a.workers)
    if a.no_prepare:
        model, opt = accelerator.prepare(model, opt)
    else:
        model, opt, loader = accelerator.prepare(model, opt, loader)
    for epoch in range(a.epochs):
        for images, labels in loader:
            record(epoch, images, labels)
            x = images.reshape(len(images), -1).float() / 255
            loss = torch.nn.functional.cross_entropy(model(x), labels)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # leaves the process group together (gloo aborts otherwise)


if __name__ == "__main__":
    main()
