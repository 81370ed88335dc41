"""torch integration: an IterableDataset for DataLoader workers and DDP ranks, and the uint8 to
float conversion that belongs on the GPU."""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from larder.client import Client

# DataLoader workers a dataset may have (one epoch counter each, in shared memory).
_MAX_WORKERS = 1024


class _EpochClock:
    """Which epoch each iteration of a dataset is, seen alike by the training process and its
    DataLoader workers, fresh or persistent: shared memory made with the dataset, inherited by
    forked workers and handed to spawned ones. `set(e)` makes the next iteration epoch e (and
    `start_step` its first step); each later iteration is the next epoch. Every worker iterates
    once per epoch, so each counts its own iterations and they agree."""

    def __init__(self, epoch: int, start_step: int):
        import multiprocessing.sharedctypes as shared

        self._base = shared.RawArray("q", [epoch, start_step])
        self._iterations = shared.RawArray("q", _MAX_WORKERS)

    def set(self, epoch: int, start_step: int = 0) -> None:
        self._base[0], self._base[1] = epoch, start_step
        for k in range(_MAX_WORKERS):
            self._iterations[k] = 0

    def next(self, worker: int) -> Tuple[int, int]:
        """(epoch, start step) of the iteration worker `worker` starts now."""
        done = self._iterations[worker]
        self._iterations[worker] = done + 1
        return self._base[0] + done, self._base[1] if done == 0 else 0

    def peek(self) -> int:
        return self._base[0] + max(self._iterations[k] for k in range(_MAX_WORKERS))

    def __getstate__(self):
        from multiprocessing import context

        if context.get_spawning_popen() is not None:  # handing it to a spawned worker
            return {"base": self._base, "iterations": self._iterations}
        # Any other copy (deepcopy, pickling to disk) gets its own clock, set where this one is.
        return {"epoch": self.peek(), "start_step": 0}

    def __setstate__(self, state):
        if "base" in state:
            self._base, self._iterations = state["base"], state["iterations"]
        else:
            self.__init__(state["epoch"], state["start_step"])


def to_float(
    images: torch.Tensor,
    device=None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
) -> torch.Tensor:
    """uint8 [B, C, H, W] -> float32 in [0, 1] on `device` (normalized per channel if mean and
    std are given). The transfer moves uint8, a quarter of the bytes of float32."""
    x = images.to(device, non_blocking=True).float().div_(255.0)
    if mean is not None and std is not None:
        m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        x = x.sub_(m).div_(s)
    return x


def shard_batches(num_samples: int, batch_size: int, rank: int, world_size: int, drop_last: bool) -> int:
    """Batches in shard `rank` of `world_size` (the daemon's sharding: every world_size-th sample)."""
    n = max(0, (num_samples - rank + world_size - 1) // world_size)
    return n // batch_size if drop_last else (n + batch_size - 1) // batch_size


def resume_points(start_step: int, batches_per_worker: List[int]) -> Tuple[List[int], int]:
    """Where each DataLoader worker's shard stood when the loader had yielded `start_step`
    batches, and whose turn was next: the loader takes batches from its workers in turn,
    skipping workers that have run out."""
    k = len(batches_per_worker)
    done = [0] * k
    w = 0
    for _ in range(start_step):
        for _ in range(k):
            if done[w] < batches_per_worker[w]:
                break
            w = (w + 1) % k
        else:
            break  # every worker has run out: start_step is past the end of the epoch
        done[w] += 1
        w = (w + 1) % k
    return done, w


class LarderIterableDataset(IterableDataset):
    """Batches of `dataset` from larderd as torch tensors: (images, labels) for a dataset of an
    image and a label, a tuple of the `fields` named (in that order; `X_lengths` names a
    variable field's lengths), or else a dict of every field (see `larder.Batch.torch`).

    Use with `DataLoader(ds, batch_size=None, num_workers=K)`: the daemon batches. Each DDP rank
    (given as rank/world_size, or taken from torch.distributed when it is initialized before the
    dataset is made or `set_epoch` is called) and each
    DataLoader worker streams its own shard, so every sample comes exactly once per epoch
    across all of them. No sample is repeated to even out the ranks, so their batch counts can
    differ: train a DDP epoch inside `with model.join():`.

    Iterating the dataset again starts the next epoch, in the training process and in
    DataLoader workers alike (persistent or not), so frameworks that never call `set_epoch`
    (Lightning, for an IterableDataset) still get a new order every epoch; `set_epoch(e)` makes
    the next iteration epoch e. `start_step` resumes that epoch after the loader (on this rank)
    has yielded that many batches.
    """

    def __init__(
        self,
        dataset: str,
        batch_size: int,
        *,
        address: Optional[str] = None,
        seed: int = 0,
        epoch: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        start_step: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        reconnect_timeout: float = 60.0,
        fields: Optional[Sequence[str]] = None,
        variable_layout: str = "padded",
    ):
        super().__init__()
        self.dataset = dataset
        self.batch_size = batch_size
        self.address = address
        self.seed = seed
        self._clock = _EpochClock(epoch, start_step)
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.reconnect_timeout = reconnect_timeout
        self.fields = tuple(fields) if fields is not None else None
        self.variable_layout = variable_layout
        self._ddp = self._resolve_ddp()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration (of the furthest worker) serves."""
        return self._clock.peek()

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The next iteration serves epoch `epoch`, from step `start_step`; later ones follow."""
        self._clock.set(epoch, start_step)
        self._ddp = self._resolve_ddp()

    def _resolve_ddp(self) -> Tuple[int, int]:
        # Called in the training process: DataLoader workers, where __iter__ runs, are other
        # processes that have no process group of their own.
        if self.rank is not None or self.world_size is not None:
            return self.rank or 0, self.world_size or 1
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        rank, world = self._ddp
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        # Worker k of K on rank r of W streams shard r*K + k of W*K.
        shard_world = world * workers
        epoch, start_step = self._clock.next(worker)
        with Client(self.address, self.reconnect_timeout) as client:
            shard, start = worker, 0
            if start_step:
                n = client.dataset(self.dataset).num_samples
                per_worker = [
                    shard_batches(n, self.batch_size, rank * workers + k, shard_world, self.drop_last)
                    for k in range(workers)
                ]
                done, turn = resume_points(start_step, per_worker)
                # The resumed loader asks worker 0 first: let it serve the shard whose turn it
                # is, so the epoch goes on in the same order as if it had not stopped.
                shard = (worker + turn) % workers
                start = done[shard]
            for batch in client.stream(
                self.dataset,
                self.batch_size,
                seed=self.seed,
                epoch=epoch,
                rank=rank * workers + shard,
                world_size=shard_world,
                start_batch=start,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
                fields=self._served_fields(),
                variable_layout=self.variable_layout,
            ):
                yield batch.torch(self.fields)

    def _served_fields(self) -> Optional[List[str]]:
        """The dataset fields the requested tensors need (X_lengths and X_offsets come with X)."""
        if self.fields is None:
            return None
        names: List[str] = []
        for f in self.fields:
            for suffix in ("_lengths", "_offsets"):
                if f.endswith(suffix):
                    f = f[: -len(suffix)]
                    break
            if f not in names:
                names.append(f)
        return names
