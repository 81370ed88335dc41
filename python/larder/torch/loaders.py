"""DataLoaders in the shape training scripts use: `loader(ds, ...)` takes a script's DataLoader
arguments for a larder dataset (no worker processes, the script's sampler followed), and
`DataLoader(dataset, ...)` is torch's DataLoader for any dataset, larder's for a larder one."""

from __future__ import annotations

import inspect
import logging
from typing import Optional, Tuple

import torch
from torch.utils.data import IterableDataset

from larder.torch import datasets
from larder.torch.dataset import LarderIterableDataset

log = logging.getLogger("larder")


class LoaderDataset(IterableDataset):
    """The dataset as `loader.dataset`: iterates it, and `len()` is its number of samples (what
    scripts divide by), where the dataset's own `len()` is batches (what DataLoader needs)."""

    def __init__(self, ds: "LarderIterableDataset"):
        super().__init__()
        self.ds = ds
        # The dataset the script made, when it was not `ds` itself (a larder.datasets
        # ImageFolder): its attributes (classes, root, ...) come first.
        self.origin = None
        self._len: Optional[int] = None

    def __iter__(self):
        return iter(self.ds)

    def __len__(self) -> int:
        if self._len is None:
            self._len = self.ds.epoch_samples(whole=True)
        return self._len

    def __getattr__(self, name):
        if name in ("ds", "origin") or name.startswith("__"):
            raise AttributeError(name)
        if self.origin is not None and hasattr(self.origin, name):
            return getattr(self.origin, name)
        return getattr(self.ds, name)


class EpochSampler:
    """`loader.sampler`: what scripts call on a sampler. `set_epoch(e)` makes the next pass
    epoch e (the dataset's own `set_epoch`); `len()` is the samples this rank gets an epoch (as
    `DistributedSampler`'s; with `even_batches=False`, its `num_samples`: the dataset's samples
    over the ranks, rounded up). Iterating it yields None forever, as DataLoader's sampler for an
    iterable dataset does: the daemon orders the samples."""

    def __init__(self, ds: "LarderIterableDataset"):
        self.ds = ds
        self._len: Optional[Tuple[Tuple[int, int], int]] = None

    def set_epoch(self, epoch: int) -> None:
        self.ds.set_epoch(epoch)

    def __len__(self) -> int:
        rank, world, _ = self.ds.ranks()
        if self._len is None or self._len[0] != (rank, world):
            if not self.ds.even_batches and not self.ds.drop_last:
                # Every sample once, ranks' shares differing: DistributedSampler's num_samples,
                # the share scripts multiply by the world size to find a tail left out (none).
                n = -(-self.ds.epoch_samples(whole=True) // world)
            else:
                n = self.ds.epoch_samples()
            self._len = ((rank, world), n)
        return self._len[1]

    def __iter__(self):
        while True:
            yield None


class Loader(torch.utils.data.DataLoader):
    """A DataLoader over a LarderIterableDataset in the shape training scripts expect (see
    `loader`)."""

    def __init__(self, ds: "LarderIterableDataset"):
        # Pinning is the dataset's (its ring pinned once), not DataLoader's (a copy a batch).
        super().__init__(ds, batch_size=None, num_workers=0)
        # DataLoader guards these once made; a script reads them.
        object.__setattr__(self, "dataset", LoaderDataset(ds))
        object.__setattr__(self, "sampler", EpochSampler(ds))

    def __len__(self) -> int:
        return len(self.dataset.ds)


def loader(
    dataset: "LarderIterableDataset",
    batch_size=None,
    shuffle=None,
    sampler=None,
    batch_sampler=None,
    num_workers: int = 0,
    collate_fn=None,
    pin_memory: bool = False,
    drop_last=None,
    timeout: float = 0,
    worker_init_fn=None,
    prefetch_factor=None,
    persistent_workers: bool = False,
    **_ignored,
) -> Loader:
    """`torch.utils.data.DataLoader`'s arguments, as a script passes them, for a larder dataset:
    `DataLoader(train_dataset, batch_size=256, shuffle=True, num_workers=4, sampler=...)`
    becomes `larder.torch.loader(train_dataset, batch_size=256, shuffle=True, num_workers=4,
    sampler=...)` unchanged. The daemon batches, shuffles and shards (the dataset's
    `batch_size`, `seed`, `shuffle`, rank and `drop_last` decide), and does the work workers
    would: no worker process is started (they would copy every batch once more: a sixth of the
    speed at 3x224x224), batches come into this process in shared memory with a read-ahead
    thread. What it leaves aside it says once in the log. `loader.sampler.set_epoch(e)` and
    `len(loader.sampler)` (this rank's samples) work as with `DistributedSampler`;
    `len(loader.dataset)` is the dataset's samples, `len(loader)` this rank's batches."""
    if not isinstance(dataset, LarderIterableDataset):
        raise TypeError(
            f"larder.torch.loader takes a LarderIterableDataset, not {type(dataset).__name__}; "
            "for another dataset use torch.utils.data.DataLoader"
        )
    left = []
    if num_workers:
        left.append(f"num_workers={num_workers} (no worker processes: the daemon does their work)")
    if shuffle is not None and bool(shuffle) != dataset.shuffle:
        left.append(f"shuffle={shuffle} (the dataset's shuffle={dataset.shuffle} decides)")
    if sampler is not None:
        name = type(sampler).__name__
        left.append(f"sampler={name} (the daemon shards by rank: every sample once per epoch)")
        # The script goes on calling its own sampler's set_epoch: the dataset follows it.
        own = getattr(sampler, "set_epoch", None)
        if callable(own):
            def set_epoch(epoch, _own=own):
                _own(epoch)
                dataset.set_epoch(epoch)

            try:
                sampler.set_epoch = set_epoch
            except (AttributeError, TypeError):
                pass
    if batch_sampler is not None:
        left.append("batch_sampler (the daemon batches)")
    if batch_size is not None and batch_size != dataset.batch_size:
        left.append(f"batch_size={batch_size} (the dataset's batch_size={dataset.batch_size} decides)")
    if drop_last is not None and bool(drop_last) != dataset.drop_last:
        left.append(f"drop_last={drop_last} (the dataset's drop_last={dataset.drop_last} decides)")
    if collate_fn is not None:
        left.append("collate_fn (batches come collated; apply it to each batch in the loop)")
    for name in ("worker_init_fn", "prefetch_factor", "persistent_workers", "timeout"):
        value = locals()[name]
        if value not in (None, False, 0):
            left.append(f"{name} (no workers)")
    left += [f"{k} (not a larder option)" for k in _ignored]
    if left:
        log.info("larder.torch.loader(%s): left aside: %s", dataset.dataset, "; ".join(left))
    if pin_memory:
        dataset.pin_memory = True
    return Loader(dataset)


def DataLoader(dataset, *args, **kwargs) -> torch.utils.data.DataLoader:
    """`torch.utils.data.DataLoader`, with its arguments, for any dataset: a larder dataset
    (`larder.torch.datasets.ImageFolder`, or a LarderIterableDataset) gets `loader`'s (batches
    from the daemon, no worker processes, the script's sampler's `set_epoch` followed), any
    other torch's own DataLoader. So a script's `torch.utils.data.DataLoader(` lines become
    `DataLoader(` after `from larder.torch import datasets, DataLoader`. A larder ImageFolder
    is shuffled when the loader asks for it (`shuffle=True`, or a sampler whose `shuffle` is
    true, as `DistributedSampler`'s is by default), else served in order, every image once."""
    if not isinstance(dataset, (datasets.ImageFolder, LarderIterableDataset)):
        return torch.utils.data.DataLoader(dataset, *args, **kwargs)
    bound = inspect.signature(torch.utils.data.DataLoader.__init__).bind(None, dataset, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop("self", None)
    named.pop("dataset", None)
    named.update(named.pop("kwargs", {}))
    if isinstance(dataset, datasets.ImageFolder):
        folder = dataset
        # The daemon batches: the stream is made at the loader's batch size (torch's default 1).
        batch_size = named.get("batch_size", 1)
        if batch_size is None:
            raise ValueError("DataLoader(batch_size=None) over a larder ImageFolder: give the batch size")
        sampler = named.get("sampler")
        shuffle = named.get("shuffle")
        if not shuffle and sampler is not None:
            shuffle = getattr(sampler, "shuffle", type(sampler).__name__ == "RandomSampler")
        dataset = folder.stream(batch_size, shuffle=bool(shuffle), drop_last=bool(named.get("drop_last", False)))
        made = loader(dataset, **named)
        made.dataset.origin = folder  # `loader.dataset.classes` and the like, as torchvision's
        return made
    return loader(dataset, **named)
