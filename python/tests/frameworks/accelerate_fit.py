"""Accelerate, as its docs show: accelerator.prepare(model, optimizer, dataloader) with its
defaults. Records the ids each process trains on, per epoch.

    torchrun --nproc_per_node 2 accelerate_fit.py ADDRESS OUT --workers K --epochs E [--no-prepare]

The tests run it with others in one process (runs.py), calling main(args).
"""

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Recorder, arguments, loss, model  # noqa: E402

from larder.torch import LarderIterableDataset  # noqa: E402


def main(argv=None):
    p = arguments(__doc__)
    p.add_argument("--no-prepare", action="store_true", help="keep the DataLoader out of prepare()")
    p.add_argument("--dispatch-batches", choices=["default", "false"], default="default")
    a = p.parse_args(argv)
    config = DataLoaderConfiguration(dispatch_batches=False if a.dispatch_batches == "false" else None)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    record = Recorder(a.out, accelerator.process_index)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(LarderIterableDataset("train", 10, address=a.address, seed=3),
                        batch_size=None, num_workers=a.workers)
    if a.no_prepare:
        net, opt = accelerator.prepare(net, opt)
    else:
        net, opt, loader = accelerator.prepare(net, opt, loader)
    for epoch in range(a.epochs):
        for images, labels in loader:
            record(epoch, images, labels)
            opt.zero_grad()
            accelerator.backward(loss(net, images, labels))
            opt.step()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # leaves the process group together (gloo aborts otherwise)


if __name__ == "__main__":
    main()
