"""A plain DDP loop under torchrun, as the README shows it: DataLoader workers, persistent or
not, or torchdata's StatefulDataLoader. Records the ids each rank trains on, per epoch; can stop
after some steps saving each rank's loader state, and resume from it.

    torchrun --nproc_per_node 2 torchrun_fit.py ADDRESS OUT --workers K --epochs E
        [--persistent] [--set-epoch] [--stateful] [--stop-after S] [--resume DIR]

The tests run it with others in one process (runs.py), calling main(args).
"""

import pathlib
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Recorder, arguments, loss, model  # noqa: E402

from larder.torch import LarderIterableDataset  # noqa: E402


def main(argv=None):
    p = arguments(__doc__, workers=2)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--set-epoch", action="store_true")
    p.add_argument("--stateful", action="store_true")
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = Recorder(a.out, rank)
    net = torch.nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ds = LarderIterableDataset("train", 7, address=a.address, seed=3)
    if a.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        Loader = DataLoader
    loader = Loader(ds, batch_size=None, num_workers=a.workers, persistent_workers=a.persistent)
    first_epoch = 0
    if a.resume:
        state = torch.load(pathlib.Path(a.resume) / f"state-{rank}.pt", weights_only=False)
        loader.load_state_dict(state["loader"])
        first_epoch = state["epoch"]
    step = 0
    for epoch in range(first_epoch, a.epochs):
        if a.set_epoch and not (a.resume and epoch == first_epoch):
            ds.set_epoch(epoch)
        for images, labels in loader:
            record(epoch, images, labels)
            opt.zero_grad()
            loss(net, images, labels).backward()
            opt.step()
            step += 1
            if step == a.stop_after:
                torch.save({"loader": loader.state_dict(), "epoch": epoch},
                           pathlib.Path(a.out) / f"state-{rank}.pt")
                dist.barrier()
                dist.destroy_process_group()
                return
    dist.barrier()  # every rank done with its collectives before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
