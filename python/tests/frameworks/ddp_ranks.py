"""DDP ranks of a real process group, each rank's datasets made before the group is, as a
DataModule would make them: the rank is resolved when iteration starts, in forked and in spawned
DataLoader workers. Writes each rank's sample ids and len(loader), per kind of worker.

    torchrun --nproc_per_node 2 ddp_ranks.py ADDRESS OUT

The tests run it with others in one process (runs.py), calling main(args).
"""

import argparse
import json
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import sample_ids  # noqa: E402

from larder.torch import LarderIterableDataset  # noqa: E402

CONTEXTS = ("fork", "spawn")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("address")
    p.add_argument("out")
    a = p.parse_args(argv)
    datasets = {context: LarderIterableDataset("train", 16, address=a.address, seed=9) for context in CONTEXTS}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for context, ds in datasets.items():
            loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
            ids = []
            for images, labels in loader:
                assert images.dtype == torch.uint8 and images.shape[1:] == (2, 4, 4)
                ids += sample_ids(images, labels)
            record = {"ids": ids, "len": len(loader)}
            (pathlib.Path(a.out) / f"{context}-rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
