"""torch integration: an IterableDataset for DataLoader workers and DDP ranks, and the uint8 to
float conversion that belongs on the GPU."""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from larder.client import Client, _request

# Connections a forked worker inherited from its parent, kept from being closed in the child.
_INHERITED: List[Client] = []
# The connections datasets opened in this process, closed before the interpreter exits (a
# gRPC channel left to the interpreter's last moments can abort the process as its threads go).
_OPENED: "weakref.WeakSet[Client]" = weakref.WeakSet()


@atexit.register
def _close_opened() -> None:
    for client in list(_OPENED):
        if getattr(client, "_pid", os.getpid()) == os.getpid():
            try:
                client.close()
            except Exception:
                pass

# DataLoader workers a dataset may have (one epoch counter each, in shared memory).
_MAX_WORKERS = 1024

# Whether workers were told that batches through them are copied once more: shared memory
# made at import, so forked workers of every epoch (persistent or not) say it once in all.
def _shared_flag():
    import multiprocessing.sharedctypes as shared

    return shared.RawValue("b", 0)


_WORKERS_WARNED = _shared_flag()

_WORKERS_WARNING = (
    "larder: LarderIterableDataset is iterated in DataLoader workers (num_workers=%d): each "
    "batch is pickled from the worker to the training process, a copy the recommended setup "
    "does not make (at 3x224x224 about a sixth of its speed; see the README's delivery table). "
    "The daemon already does what workers would: use DataLoader(ds, batch_size=None, "
    "num_workers=0)."
)


def _warn_workers(info) -> None:
    """Says once, from the first worker, that DataLoader workers cost a copy per batch."""
    if info is None or info.id != 0 or _WORKERS_WARNED.value:
        return
    _WORKERS_WARNED.value = 1
    import warnings

    warnings.warn(_WORKERS_WARNING % info.num_workers, RuntimeWarning, stacklevel=3)


class _EpochClock:
    """Which epoch each iteration of a dataset is, seen alike by the training process and its
    DataLoader workers, fresh or persistent: shared memory made with the dataset, inherited by
    forked workers and handed to spawned ones. `set(e, start_sample, start_step)` makes the next
    iteration epoch e from there; each later iteration is the next epoch, from its start. Every
    worker iterates once per epoch, so each counts its own iterations and they agree."""

    def __init__(self, epoch: int, start_sample: int, start_step: int):
        import multiprocessing.sharedctypes as shared

        self._base = shared.RawArray("q", [epoch, start_sample, start_step])
        self._iterations = shared.RawArray("q", _MAX_WORKERS)

    def set(self, epoch: int, start_sample: int = 0, start_step: int = 0) -> None:
        self._base[0], self._base[1], self._base[2] = epoch, start_sample, start_step
        for k in range(_MAX_WORKERS):
            self._iterations[k] = 0

    def next(self, worker: int) -> Tuple[int, int, int]:
        """(epoch, start sample, start step) of the iteration worker `worker` starts now."""
        done = self._iterations[worker]
        self._iterations[worker] = done + 1
        if done == 0:
            return self._base[0], self._base[1], self._base[2]
        return self._base[0] + done, 0, 0

    def resumed(self, worker: int, epoch: int) -> None:
        """Worker `worker` starts epoch `epoch` now (restored from a checkpoint); its later
        iterations follow it."""
        self._iterations[worker] = max(0, epoch - self._base[0] + 1)

    def peek(self) -> int:
        return self._base[0] + max(self._iterations[k] for k in range(_MAX_WORKERS))

    def __getstate__(self):
        from multiprocessing import context

        if context.get_spawning_popen() is not None:  # handing it to a spawned worker
            return {"base": self._base, "iterations": self._iterations}
        # Any other copy (deepcopy, pickling to disk) gets its own clock, set where this one is.
        return {"epoch": self.peek()}

    def __setstate__(self, state):
        if "base" in state:
            self._base, self._iterations = state["base"], state["iterations"]
        else:
            self.__init__(state["epoch"], 0, 0)


def exact_counts(correct: "torch.Tensor", valid: "torch.Tensor") -> Tuple[int, int]:
    """(correct, total) over every rank, each sample counted once: `correct` is a bool (or
    0/1) tensor per sample of this rank's evaluation batches, `valid` their masks (the
    dataset's `valid=True`), each concatenated over the epoch or given batch by batch and
    summed by the caller. Summed over the ranks when torch.distributed is initialized."""
    counts = torch.stack([(correct.bool() & valid.to(correct.device)).sum(),
                          valid.to(correct.device).sum()]).to(torch.int64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl" and not counts.is_cuda:
            counts = counts.cuda()
        torch.distributed.all_reduce(counts)
    return int(counts[0]), int(counts[1])


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


def _accelerate_role(ds) -> Optional[Tuple[int, int]]:
    """Finds Accelerate around `ds` on the call stack, which a forked DataLoader worker shares
    with the training process up to the fork. Under its DataLoaderDispatcher: (process index,
    processes). Under its IterableDatasetShard (dispatch_batches=False), which would take a
    part of each rank's part: an error that says what to do instead."""
    if "accelerate" not in sys.modules:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        kind = type(obj)
        if kind.__module__.startswith("accelerate.") and getattr(obj, "dataset", None) is ds:
            if kind.__name__ == "DataLoaderDispatcher":
                return obj.state.process_index, obj.state.num_processes
            if kind.__name__ == "IterableDatasetShard":
                raise RuntimeError(
                    "Accelerate's dispatch_batches=False shards LarderIterableDataset's batches "
                    "again, which would lose data: keep the default "
                    "(DataLoaderConfiguration(dispatch_batches=None)), or, faster, leave the "
                    "DataLoader out of accelerator.prepare() (each process streams its own "
                    "shard; see the README)"
                )
        frame = frame.f_back
    return None


def _plan_elsewhere(address, timeout, dataset, batch_size, shard) -> int:
    """Batches a stream would serve, asked by a short-lived process: the training process asks
    for len() (Lightning does) before it forks DataLoader workers, and a process that has used
    gRPC cannot fork safely (a worker's new connection can hang for good)."""
    import json
    import subprocess

    code = (
        "import json, sys; from larder.client import Client, LarderError; a = json.loads(sys.argv[1])\n"
        "try: print(Client(a['address'], a['timeout']).plan(a['dataset'], a['batch_size'], **a['shard']).num_batches)\n"
        "except LarderError as e: sys.exit(str(e))"
    )
    arg = json.dumps({"address": address, "timeout": timeout, "dataset": dataset,
                      "batch_size": batch_size, "shard": shard})
    path = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
    try:
        out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, env=env,
                             timeout=60 + 2 * timeout)
    except subprocess.TimeoutExpired:
        from larder.client import LarderError

        raise LarderError(f"len(): the daemon at {address} did not answer in {60 + 2 * timeout:.0f} s")
    if out.returncode != 0:
        from larder.client import LarderError

        raise LarderError(out.stderr.strip() or f"len() failed (exit status {out.returncode})")
    return int(out.stdout)


def _position(epoch: int, sample: int = 0, step: int = 0, batches: int = 0) -> dict:
    """A dataset's state: an iteration of `epoch` that began at `sample` of the epoch's global
    order and step `step`, has yielded `batches` batches, and stands at `sample` (the last
    batch's resume_sample once it has yielded one)."""
    return {"epoch": epoch, "sample": sample, "base_sample": sample, "base_step": step, "batches": batches}


class LarderIterableDataset(IterableDataset):
    """Batches of `dataset` from larderd as torch tensors: (images, labels) for a dataset of an
    image and a label, a tuple of the `fields` named (in that order; `X_lengths` names a
    variable field's lengths), or else a dict of every field (see `larder.Batch.torch`).

    Use with `DataLoader(ds, batch_size=None)`: the daemon batches. The fastest setup is
    `num_workers=0`: the daemon does the work DataLoader workers would, the batches arrive in
    shared memory and a background thread keeps `prefetch` of them ready, with nothing pickled
    between processes (see the README's table). DataLoader workers work too: each DDP rank (given
    as rank/world_size, or taken from torch.distributed or torchrun's RANK/WORLD_SIZE) and each
    worker streams its own shard, and every sample comes exactly once per epoch across all of
    them. `even_batches` (default) gives every rank the same number of batches, repeating a few
    samples like `DistributedSampler`, so a DDP loop never waits on a rank that ran out.

    Batches in the shape a training loop expects: `normalize=(mean, std)` (torchvision's
    numbers, e.g. ImageNet's), `device=`, `dtype=`, `channels_last=` give the images as float,
    normalized on the device (the transfer moves uint8, a quarter of the bytes); the rest move
    to the device. Without them, uint8 as served: the fastest path.

    Exact evaluation under DDP: with `valid=True` each batch comes with its validity mask as
    one more element (or a "valid" entry), bool [B], False for the padding samples even_batches
    adds to the last round; count `valid` samples only and all-reduce the counts
    (`exact_counts`): every image is counted exactly once, and every rank still gets the same
    number of batches (so a loop that all-reduces every batch, as timm's does, never waits).

    `pipeline="train"` gives each sample the dataset's random crop and flip (configured in the
    daemon, drawn from seed, epoch and sample id, so a resumed epoch is byte-identical);
    `"eval"` (default) its center crop. Samples whose files do not decode are left out of their
    batch (listed by `larder bad`), so a batch may be smaller than `batch_size`.

    Iterating the dataset again starts the next epoch, in the training process and in
    DataLoader workers alike (persistent or not), so frameworks that never call `set_epoch`
    (Lightning, for an IterableDataset) still get a new order every epoch; `set_epoch(e)` makes
    the next iteration epoch e. `state_dict()` / `load_state_dict()` resume mid-epoch (torchdata's
    `StatefulDataLoader` calls them): iterated in the training process, the state is the
    position in the epoch's global order, so a job resumed on another number of ranks or workers
    goes on with exactly the samples not yet seen; in DataLoader workers, each worker's own
    position (resume with the same setup). `start_step` resumes the first epoch after the loader
    (on this rank) has yielded that many batches.
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
        even_batches: bool = True,
        reconnect_timeout: float = 60.0,
        fields: Optional[Sequence[str]] = None,
        variable_layout: str = "padded",
        transport: str = "auto",
        prefetch: int = 2,
        pin_memory: bool = False,
        pipeline: str = "eval",
        valid: bool = False,
        normalize: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
        device=None,
        dtype: Optional[torch.dtype] = None,
        channels_last: bool = False,
    ):
        super().__init__()
        # Bad arguments fail here rather than at the first batch (Client.stream's own checks).
        _request(dataset, batch_size, variable_layout=variable_layout, pipeline=pipeline)
        self.dataset = dataset
        self.batch_size = batch_size
        self.address = address
        self.seed = seed
        self._clock = _EpochClock(epoch, 0, start_step)
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.reconnect_timeout = reconnect_timeout
        self.fields = tuple(fields) if fields is not None else None
        self.variable_layout = variable_layout
        self.transport = transport
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.pipeline = pipeline
        # Yield each batch's validity mask too (bool [B], False for even_batches' padding).
        self.valid = valid
        # The images as the loop expects them: float on `device`, normalized (None: uint8 as
        # served, the fastest path).
        self.normalize = normalize
        self.device = device
        self.dtype = dtype
        self.channels_last = channels_last
        # What the training process saw when it handed this copy to a spawned DataLoader
        # worker, for the worker to use: "ddp", its (rank, world size), and "accelerate", its
        # place under Accelerate's dispatcher (see _accelerate_role). None: not handed over.
        self._handed: Optional[dict] = None
        # Where this copy's iteration stands: epoch, the start_sample and start_step it began
        # from, batches it has yielded, and the resume_sample of the last one.
        self._position: Optional[dict] = None
        # A state loaded in a DataLoader worker, for that worker's next iteration.
        self._restored: Optional[dict] = None
        # The connection of the process iterating this copy, kept across epochs (with its
        # shared-memory ring), and that process's pid: a forked worker makes its own.
        self._client: Optional[Client] = None
        self._client_pid: Optional[int] = None
        # ((rank, world size), batches per epoch) as __len__ last asked the daemon.
        self._len_cache: Optional[Tuple[Tuple[int, int], int]] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_client"] = state["_client_pid"] = None  # connections stay in their process
        from multiprocessing import context

        if context.get_spawning_popen() is not None:
            # Handed to a spawned DataLoader worker as the training process starts iterating:
            # its ranks and its place under Accelerate as they are now.
            state["_handed"] = {"ddp": self._resolve_ddp(), "accelerate": self._accelerate_role()}
        return state

    def _connection(self) -> Client:
        if self._client is None or self._client_pid != os.getpid():
            if self._client is not None:
                # Inherited through fork: never used or closed here (gRPC is not fork-safe).
                _INHERITED.append(self._client)
            self._client = Client(self.address, self.reconnect_timeout)
            self._client_pid = os.getpid()
            self._client._pid = self._client_pid
            _OPENED.add(self._client)
        return self._client

    def input_stats(self):
        """Is the job input-bound? How the loop iterating this dataset in this process spent its
        time: the share of its step time waiting for batches over the last 20 s, the verdict,
        and the daemon's cause and fix (see `larder.client.InputStats`). With DataLoader workers
        it is measured in the worker (use `larder.torch.loader`, which starts none)."""
        return self._connection().input_stats(self.dataset)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration (of the furthest worker) serves."""
        return self._clock.peek()

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The next iteration serves epoch `epoch`, from step `start_step`; later ones follow."""
        _accelerate_role(self)  # Accelerate calls this first: a setup that loses data fails here
        self._clock.set(epoch, 0, start_step)

    def state_dict(self) -> dict:
        """Where this copy of the dataset stands: see the class docstring."""
        if self._position is None:
            return _position(self._clock.peek())
        return dict(self._position)

    def load_state_dict(self, state: dict) -> None:
        """Resumes from `state_dict()`: the next iteration goes on where it stood."""
        if get_worker_info() is not None:
            self._restored = dict(state)  # this worker's own shard, as it stood
        else:
            self._clock.set(state["epoch"], state["sample"], 0)
        self._position = dict(state)

    def _resolve_ddp(self) -> Tuple[int, int]:
        """(rank, world size) as they are now: given, or torch.distributed's (a forked worker
        inherits its parent's process group), or torchrun's RANK/WORLD_SIZE, or what the
        training process saw when it handed this copy to a spawned worker."""
        if self.rank is not None or self.world_size is not None:
            return self.rank or 0, self.world_size or 1
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return self._handed["ddp"] if self._handed else (0, 1)

    def _accelerate_role(self) -> Optional[Tuple[int, int]]:
        """(process index, processes) when Accelerate's DataLoaderDispatcher iterates this
        dataset (accelerator.prepare's default for an IterableDataset), else None."""
        if self._handed is not None:
            return self._handed["accelerate"]
        return _accelerate_role(self)

    def _ranks(self) -> Tuple[int, int, bool]:
        """(rank, world size, whether this process serves batches). Under Accelerate's default
        for an IterableDataset (dispatch_batches), process 0 iterates and hands each process its
        part of every batch, the others never take one: process 0 serves the whole epoch, as
        rank 0 of 1, and the others nothing."""
        role = self._accelerate_role()
        if role is not None:
            return 0, 1, role[0] == 0
        rank, world = self._resolve_ddp()
        return rank, world, True

    def _shard(self, rank: int, world: int) -> dict:
        """What picks this dataset's batches for `rank` of `world`, as Client.stream and
        Client.plan take it."""
        return dict(seed=self.seed, rank=rank, world_size=world, shuffle=self.shuffle,
                    drop_last=self.drop_last, even_batches=self.even_batches,
                    fields=self._served_fields(), variable_layout=self.variable_layout,
                    pipeline=self.pipeline)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        _warn_workers(info)
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        rank, world, serves = self._ranks()
        if not serves:
            return
        _note_uneven(self, world)
        restored, self._restored = self._restored, None
        if restored is not None:
            epoch, start_sample, start_step = restored["epoch"], restored["base_sample"], restored["base_step"]
            start_batch = restored["batches"]
            self._clock.resumed(worker, epoch)
        else:
            epoch, start_sample, start_step = self._clock.next(worker)
            start_batch = 0
        position = self._position = _position(epoch, start_sample, start_step, start_batch)
        client = self._connection()
        for batch in client.stream(
            self.dataset,
            self.batch_size,
            epoch=epoch,
            worker=worker,
            num_workers=workers,
            start_sample=start_sample,
            start_step=start_step,
            start_batch=start_batch,
            transport=self.transport,
            prefetch=self.prefetch,
            pin_memory=self.pin_memory,
            **self._shard(rank, world),
        ):
            out = batch.torch(self.fields)
            device = self._device()
            if (self.normalize is not None or device is not None or self.dtype is not None
                    or self.channels_last):
                out = self._as_expected(out, device)
            if self.valid:
                mask = torch.from_numpy(batch.valid)
                if device is not None:
                    mask = mask.to(device, non_blocking=True)
                out = {**out, "valid": mask} if isinstance(out, dict) else (*out, mask)
            position["batches"] += 1
            position["sample"] = batch.resume_sample
            del batch
            yield out
        # The epoch is done: a checkpoint now resumes at the start of the next one.
        self._position = _position(epoch + 1)

    def _device(self):
        """Where batches go: `device`, where "auto" is the current CUDA device when there is
        one (a script's `torch.cuda.set_device`), else None (they stay on the CPU)."""
        if isinstance(self.device, str) and self.device == "auto":
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return self.device

    def _as_expected(self, out, device):
        """The batch's images (the first tensor, or "image") as float on `device`, normalized
        by `normalize` (mean, std in [0, 1] units, torchvision's), in `dtype` and memory format;
        the other tensors moved to `device`."""
        mean, std = self.normalize if self.normalize is not None else (None, None)

        def images(x):
            if x.dtype != torch.uint8:  # already float (a float field): moved, never changed in place
                x = x.to(device, non_blocking=True) if device is not None else x.clone()
                return x.to(self.dtype) if self.dtype is not None else x
            x = to_float(x, device, mean, std)
            if self.dtype is not None:
                x = x.to(self.dtype)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            return x

        def moved(x):
            return x.to(device, non_blocking=True) if device is not None else x

        if isinstance(out, dict):
            return {k: images(v) if k == "image" else moved(v) for k, v in out.items()}
        return (images(out[0]), *(moved(x) for x in out[1:]))

    def __len__(self) -> int:
        """Batches this rank's loader yields in an epoch, for every DataLoader worker together
        (what `len(DataLoader(ds, batch_size=None))` reports, and frameworks size progress,
        schedules and the last batch by). Asked of the daemon, which holds the sharding rule,
        once per (rank, world size): the whole epoch of every worker together is no one
        stream's plan, so each iteration's stream still asks its own, once (Client.stream)."""
        _note_distributed_sampler(sys._getframe(1))
        rank, world, _ = self._ranks()  # under Accelerate, process 0's: it divides the length
        key = (rank, world)
        if self._len_cache is None or self._len_cache[0] != key:
            shard = self._shard(rank, world)
            if self._client is not None and self._client_pid == os.getpid():
                plan = self._client.plan(self.dataset, self.batch_size, **shard)
                batches = plan.num_batches
            else:
                batches = _plan_elsewhere(self.address, self.reconnect_timeout, self.dataset,
                                          self.batch_size, shard)
            self._len_cache = (key, batches)
        return self._len_cache[1]

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


# ---------------------------------------------------------------------------------------------
# A DataLoader in the shape scripts use: `larder.torch.loader(ds, ...)`.

_LOG = None


_SAMPLER_NOTED = False
_UNEVEN_NOTED = False


def _note_uneven(ds: "LarderIterableDataset", world: int) -> None:
    """Says once, under DDP, that a dataset serving every sample exactly once
    (`even_batches=False`, the default of `ImageFolder(train=False)`) may give the ranks one
    batch more or less: right for a loop that all-reduces at the end, a hang for one that syncs
    every batch."""
    global _UNEVEN_NOTED
    if _UNEVEN_NOTED or world <= 1 or ds.even_batches or ds.drop_last or ds.valid:
        return
    _UNEVEN_NOTED = True
    _log().warning(
        "larder dataset %s: every sample exactly once over %d ranks (even_batches=False), so ranks may get one "
        "batch more or less. A loop that all-reduces only at the end (pytorch/examples) is exact; one that "
        "syncs every batch (timm's validate, Accelerate's gather_for_metrics, torchmetrics' dist_sync_on_step) "
        "needs valid=True: equal batch counts, the padding marked.", ds.dataset, world)


def _note_distributed_sampler(caller) -> None:
    """Says once what to do when a `DistributedSampler` is built over a larder dataset (it asks
    the dataset's len() as it is made): the daemon shards by rank itself, so the sampler is
    only of use to `larder.torch.loader`, which follows its `set_epoch` and leaves its order
    aside; a plain DataLoader refuses a sampler for an iterable dataset."""
    global _SAMPLER_NOTED
    if _SAMPLER_NOTED or caller.f_code.co_name != "__init__":
        return
    owner = caller.f_locals.get("self")
    if owner is None or not any(c.__name__ == "DistributedSampler" for c in type(owner).__mro__):
        return
    _SAMPLER_NOTED = True
    _log().warning(
        "DistributedSampler over a larder dataset: larderd shards the epoch by rank itself. Hand the sampler "
        "to larder.torch.loader(ds, sampler=...), which follows its set_epoch() and leaves its order aside, "
        "or drop it; torch.utils.data.DataLoader refuses any sampler for a larder dataset "
        "(\"expected unspecified sampler option\").")


def _log():
    global _LOG
    if _LOG is None:
        import logging

        _LOG = logging.getLogger("larder")
    return _LOG


def _rank_samples(ds: "LarderIterableDataset", whole: bool) -> int:
    """Samples an epoch serves this rank (or, `whole`, the dataset's samples), as the daemon,
    which holds the sharding rule, plans them."""
    rank, world, _ = ds._ranks()
    shard = ds._shard(0, 1) if whole else ds._shard(rank, world)
    if whole:
        shard = dict(shard, even_batches=False, drop_last=False)
    return ds._connection().plan(ds.dataset, ds.batch_size, **shard).num_samples


class _Sizes(IterableDataset):
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
            self._len = _rank_samples(self.ds, whole=True)
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
        rank, world, _ = self.ds._ranks()
        if self._len is None or self._len[0] != (rank, world):
            if not self.ds.even_batches and not self.ds.drop_last:
                # Every sample once, ranks' shares differing: DistributedSampler's num_samples,
                # the share scripts multiply by the world size to find a tail left out (none).
                n = -(-_rank_samples(self.ds, whole=True) // world)
            else:
                n = _rank_samples(self.ds, whole=False)
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
        object.__setattr__(self, "dataset", _Sizes(ds))
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
        _log().info("larder.torch.loader(%s): left aside: %s", dataset.dataset, "; ".join(left))
    if pin_memory:
        dataset.pin_memory = True
    return Loader(dataset)


def _dataset_name(path: str, settings: dict) -> str:
    """A name for the dataset of `path` with `settings`: readable, and one per (path, settings),
    so that two scripts naming the same folder the same way share one dataset (and its cache)."""
    import hashlib
    import re

    parts = [p for p in os.path.abspath(path).split(os.sep) if p][-2:]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts)).strip("-.")[:40] or "data"
    digest = hashlib.sha256(repr((os.path.abspath(path), sorted(settings.items()))).encode()).hexdigest()[:8]
    return f"{readable}-{digest}"


def _own_folder(root, *, resize, crop, crop_pct, interpolation, scale, ratio, hflip, address,
                labels) -> Tuple[str, str]:
    """(the caller's own dataset of `root` with these settings, "images" or "hdf5"): added for
    the caller (by uid) if no earlier call did, and waited for until the daemon serves it."""
    path = os.path.abspath(os.fspath(root))
    kind = "images" if os.path.isdir(path) else "hdf5"
    table: dict = {"kind": kind}
    if kind == "images":
        train_table: dict = {}
        if scale is not None:
            train_table["scale"] = [float(x) for x in scale]
        if ratio is not None:
            train_table["ratio"] = [float(x) for x in ratio]
        if hflip is not None:
            train_table["flip"] = bool(hflip)
        table.update(resize=resize, crop=crop, train=train_table)
        if crop_pct is not None:
            table["crop_pct"] = crop_pct
        if interpolation is not None:
            table["interpolation"] = interpolation
    elif labels is not None:
        table["labels"] = labels
    name = _dataset_name(path, table)
    import pwd

    from larder.client import LarderError

    # The caller's own (by uid, not $USER): never another user's dataset of that name.
    own = f"{pwd.getpwuid(os.getuid()).pw_name}/{name}"
    with Client(address) as client:
        if own not in [d.name for d in client.datasets()]:
            try:
                client.add_dataset(name, path, **table)
            except LarderError as e:  # another of the caller's processes added it meanwhile
                import grpc

                if e.code != grpc.StatusCode.ALREADY_EXISTS:
                    raise
        # Another rank's add may still be opening it (an image folder is walked first; a large
        # one on a network file system can take minutes).
        deadline = time.monotonic() + 900
        while own not in [d.name for d in client.datasets()]:
            if time.monotonic() > deadline:
                raise LarderError(f"{own} was added but is not served (see `larder datasets`)")
            time.sleep(0.1)
    return own, kind


def ImageFolder(
    root,
    batch_size: int,
    *,
    train: bool = True,
    resize: int = 256,
    crop: int = 224,
    crop_pct: Optional[float] = None,
    interpolation: Optional[str] = None,
    scale: Optional[Tuple[float, float]] = None,
    ratio: Optional[Tuple[float, float]] = None,
    hflip: Optional[bool] = None,
    address: Optional[str] = None,
    labels: Optional[str] = None,
    **dataset_kwargs,
) -> LarderIterableDataset:
    """torchvision's `datasets.ImageFolder(root, transform)` as one larder line: the folder (or
    an HDF5 file, with `labels=` its label dataset) is added as a dataset of your own (read with
    your rights, kept across restarts: the README's "Datasets of your own"), or found among
    yours if an earlier call added it, and streamed with the train pipeline (`train=True`: random-resized crop and
    flip, torchvision's `RandomResizedCrop(crop)` recipe) or the eval one (the center `crop` of the
    image resized to `resize` on its shorter side: `Resize(resize)` + `CenterCrop(crop)`). Two
    scripts naming the same folder with the same sizes share one dataset and its cache.
    timm's recipe: `crop_pct=0.95, interpolation="bicubic"` (the image kept at floor(crop /
    crop_pct) on its shorter side, resampled bicubically); the train crop's `scale` and `ratio`
    (torchvision's and timm's `--scale`/`--ratio`) and `hflip` (False: no flips). `dataset_kwargs`
    go to LarderIterableDataset (seed, normalize, device, valid, ...). With `train=False` every
    image comes exactly once under DDP (`even_batches=False`, so ranks may get one batch more or
    less: right for a loop that all-reduces at the end, as pytorch/examples'), unless
    `valid=True` asks for equal batch counts with the padding marked (timm's per-batch
    all-reduce)."""
    full, kind = _own_folder(root, resize=resize, crop=crop, crop_pct=crop_pct, interpolation=interpolation,
                             scale=scale, ratio=ratio, hflip=hflip, address=address, labels=labels)
    pipeline = "train" if train and kind == "images" else "eval"
    dataset_kwargs.setdefault("shuffle", train)
    if not train:
        # Evaluation: every image exactly once, so a script's own loop counts right under DDP
        # (its ranks may get one batch more or less); with `valid=True` the ranks get equal
        # batch counts instead, the padding marked (for loops that all-reduce every batch).
        dataset_kwargs.setdefault("even_batches", bool(dataset_kwargs.get("valid", False)))
    return LarderIterableDataset(full, batch_size, address=address, pipeline=pipeline, **dataset_kwargs)


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
    import inspect

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


# `from larder.torch import datasets` (and `import larder.torch.datasets`): the drop-in for
# torchvision.datasets.
from larder import datasets  # noqa: E402

sys.modules[__name__ + ".datasets"] = datasets
