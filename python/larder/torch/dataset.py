"""The torch dataset: larderd's batches as tensors for a DataLoader, in the training process or
its workers, on any DDP rank, with epochs that follow each other and a state to resume from."""

from __future__ import annotations

import os
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from larder.client import Client
from larder.errors import LarderError
from larder.request import stream_request
from larder.torch.connections import inherited, open_client, plan_elsewhere
from larder.torch.epochs import EpochClock, position
from larder.torch.notes import note_distributed_sampler, note_uneven, warn_workers
from larder.torch.roles import accelerate_role
from larder.torch.tensors import to_float


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

    A job over several nodes, a larderd each: `nodes=` (and `node=`, else torchrun's
    GROUP_RANK or Slurm's SLURM_NODEID) has each node read its own part of every epoch, so its
    daemon's cache keeps serving it (see `Client.stream`; the state below resumes on another
    number of nodes too).

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
    position in the epoch's global order (with `nodes`, in the node's part, and the nodes), so a
    job resumed on another number of ranks, workers or nodes goes on with exactly the samples
    not yet seen (one change of nodes an epoch); in DataLoader workers, each worker's own
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
        nodes: Optional[int] = None,
        node: Optional[int] = None,
        partitions: int = 0,
        swap: float = 0.0,
        order_version: Optional[int] = None,
        augment_seed: Optional[int] = None,
        cohort_seed: Optional[int] = None,
        window: int = 0,
    ):
        super().__init__()
        # Bad arguments fail here rather than at the first batch (Client.stream's own checks).
        if order_version not in (None, 1, 2):
            raise ValueError(f"order_version must be 1, 2 or None (2, or a loaded state's), not {order_version!r}")
        stream_request(dataset, batch_size, variable_layout=variable_layout, pipeline=pipeline,
                       order_version=order_version or 2)
        self.dataset = dataset
        self.batch_size = batch_size
        self.address = address
        self.seed = seed
        # The form of the epochs' order: as asked (None: 2 for a new run), or as a loaded
        # state recorded it (a run keeps the form it began on).
        self.order_version = order_version
        # Whether the form is fixed (given, or a loaded state's): an epoch resumed without one
        # takes the form the daemon serves.
        self._order_fixed = order_version is not None
        # The train pipeline's crops and flips from this seed (None: the order's seed).
        self.augment_seed = augment_seed
        # A correlated order: the cohort's base order, reshuffled within windows by `seed`.
        self.cohort_seed, self.window = cohort_seed, window
        self._order = order_version or 2
        self._clock = EpochClock(epoch, 0, start_step)
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
        # A job over several nodes, a daemon each (see Client.stream): each node reads its own
        # part of every epoch. `node` defaults to torchrun's GROUP_RANK, Slurm's SLURM_NODEID,
        # else rank // (world_size // nodes).
        self.nodes = nodes
        self.node = node
        self.partitions = partitions
        self.swap = swap
        # What the training process saw when it handed this copy to a spawned DataLoader
        # worker, for the worker to use: "ddp", its (rank, world size), and "accelerate", its
        # place under Accelerate's dispatcher (see larder.torch.roles). None: not handed over.
        self._handed: Optional[dict] = None
        # Where this copy's iteration stands: epoch, the start_sample and start_step it began
        # from, batches it has yielded, and the resume_sample of the last one.
        self._position: Optional[dict] = None
        # A state loaded from another number of nodes, for the epoch it stood in (see `_split`).
        self._nodes_state: Optional[dict] = None
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
                inherited(self._client)
            self._client = open_client(self.address, self.reconnect_timeout)
            self._client_pid = os.getpid()
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
        accelerate_role(self)  # Accelerate calls this first: a setup that loses data fails here
        self._clock.set(epoch, 0, start_step)

    def state_dict(self) -> dict:
        """Where this copy of the dataset stands: see the class docstring."""
        if self._position is None:
            return position(self._clock.peek(), order=self._order)
        return dict(self._position)

    def load_state_dict(self, state: dict) -> None:
        """Resumes from `state_dict()`: the next iteration goes on where it stood, in the order
        form the state was taken in (states without one are of form 1)."""
        order = state.get("order", 1)
        if order not in (1, 2):
            raise ValueError(f"this state's order form {order!r} is unknown to this client (1 or 2)")
        mid_epoch = state.get("sample", 0) > 0 or state.get("batches", 0) > 0 or state.get("base_step", 0) > 0
        # Unshuffled epochs and a node's part are the same order in both forms.
        same_in_both = not self.shuffle or (self.nodes or 0) > 1
        if self.order_version is not None and order != self.order_version and not same_in_both:
            if mid_epoch:
                raise ValueError(
                    f"this state stands mid-epoch in an order of form {order}, and this dataset asks for form "
                    f"{self.order_version}: the rest of the epoch in another order would repeat some samples and "
                    f"skip others. Resume with order_version={order} (or leave it unset: a loaded state's form is "
                    f"kept), or from a state taken at an epoch's end")
            order = self.order_version
        self._order = order
        self._order_fixed = True
        state = {**state, "order": order}
        if get_worker_info() is not None:
            self._restored = dict(state)  # this worker's own shard, as it stood
        else:
            self._clock.set(state["epoch"], state["sample"], 0)
        self._position = dict(state)
        self._nodes_state = dict(state)

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
        return accelerate_role(self)

    def ranks(self) -> Tuple[int, int, bool]:
        """(rank, world size, whether this process serves batches), as they are now. Under Accelerate's default
        for an IterableDataset (dispatch_batches), process 0 iterates and hands each process its
        part of every batch, the others never take one: process 0 serves the whole epoch, as
        rank 0 of 1, and the others nothing."""
        role = self._accelerate_role()
        if role is not None:
            return 0, 1, role[0] == 0
        rank, world = self._resolve_ddp()
        return rank, world, True

    def epoch_samples(self, whole: bool = False) -> int:
        """Samples an epoch serves this rank (or, `whole`, the dataset's samples), as the daemon,
        which holds the sharding rule, plans them."""
        rank, world, _ = self.ranks()
        shard = self._shard(0, 1) if whole else self._shard(rank, world)
        if whole:
            shard = dict(shard, even_batches=False, drop_last=False)
        return self._connection().plan(self.dataset, self.batch_size, **shard).num_samples

    def _shard(self, rank: int, world: int) -> dict:
        """What picks this dataset's batches for `rank` of `world`, as Client.stream and
        Client.plan take it."""
        shard = dict(seed=self.seed, rank=rank, world_size=world, shuffle=self.shuffle,
                     drop_last=self.drop_last, even_batches=self.even_batches,
                     fields=self._served_fields(), variable_layout=self.variable_layout,
                     pipeline=self.pipeline, order_version=self._order, augment_seed=self.augment_seed)
        if self.window:
            shard.update(cohort_seed=self.cohort_seed, window=self.window)
        if self.nodes and self.nodes > 1 and world > 1:
            shard.update(nodes=self.nodes, node=self._node(rank, world), partitions=self.partitions,
                         swap=self.swap)
        return shard

    def _split(self, shard: dict, epoch: int, start_sample: int, in_worker: bool) -> Tuple[dict, int, dict]:
        """The epoch's node bookkeeping: the nodes it runs on and, when it began on others, those
        nodes and the position they reached (the daemon gives each node what is left of its
        partitions). Returns the shard with it, the start sample, and what a state records."""
        nodes = shard.get("nodes", 0)
        resumed = None
        state, self._nodes_state = self._nodes_state, None
        if state is not None and state.get("epoch") == epoch:
            before, earlier = state.get("nodes", 0), state.get("resumed")
            moved = f"this epoch ran on {before or 'one'} node(s) and goes on on {nodes or 'one'}"
            if before == nodes:
                resumed = earlier
            elif state.get("sample", 0) == 0 and earlier is None:
                pass  # nothing of the epoch read yet: it starts afresh on these nodes
            elif in_worker:
                raise ValueError(f"{moved}: DataLoader workers resume with the same setup (iterate in the "
                                 "training process)")
            elif earlier is not None or not before or not nodes:
                raise ValueError(f"{moved}: a job changes its number of nodes mid-epoch once, between two "
                                 "node-aware setups (nodes > 1 on both sides); resume at the epoch's end instead")
            else:
                resumed, start_sample = [before, state["sample"]], 0
        if resumed:
            shard = {**shard, "resumed_nodes": resumed[0], "resumed_sample": resumed[1]}
        return shard, start_sample, {"nodes": nodes, "resumed": resumed}

    def _node(self, rank: int, world: int) -> int:
        """This rank's node: given, or torchrun's GROUP_RANK, or Slurm's SLURM_NODEID, or its
        place when ranks are numbered node by node."""
        if self.node is not None:
            return self.node
        for var in ("GROUP_RANK", "SLURM_NODEID"):
            if var in os.environ:
                return int(os.environ[var])
        return rank // max(1, world // self.nodes)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        warn_workers(info)
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        rank, world, serves = self.ranks()
        if not serves:
            return
        note_uneven(self, world)
        restored, self._restored = self._restored, None
        if restored is not None:
            epoch, start_sample, start_step = restored["epoch"], restored["base_sample"], restored["base_step"]
            start_batch = restored["batches"]
            self._clock.resumed(worker, epoch)
        else:
            epoch, start_sample, start_step = self._clock.next(worker)
            start_batch = 0
        shard, start_sample, nodes = self._split(self._shard(rank, world), epoch, start_sample, restored is not None)
        at = self._position = {**position(epoch, start_sample, start_step, start_batch, order=self._order),
                                **nodes}
        resuming = start_sample > 0 or start_step > 0 or start_batch > 0
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
            **shard,
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
            if batch.order_version != at["order"]:
                # (Within one stream the client itself refuses a change of form.)
                if resuming and self._order_fixed:
                    raise LarderError(
                        f"the daemon serves orders of form {batch.order_version} only, and this epoch was begun in "
                        f"form {at['order']}: upgrade the daemon to resume it, or resume from an epoch's end")
                # A daemon before order forms serves form 1: the run goes on in it.
                at["order"] = self._order = batch.order_version
            at["batches"] += 1
            at["sample"] = batch.resume_sample
            del batch
            yield out
        # The epoch is done: a checkpoint now resumes at the start of the next one.
        self._position = position(epoch + 1, order=self._order)

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
        note_distributed_sampler(sys._getframe(1))
        rank, world, _ = self.ranks()  # under Accelerate, process 0's: it divides the length
        key = (rank, world)
        if self._len_cache is None or self._len_cache[0] != key:
            shard = self._shard(rank, world)
            if self._client is not None and self._client_pid == os.getpid():
                plan = self._client.plan(self.dataset, self.batch_size, **shard)
                batches = plan.num_batches
            else:
                batches = plan_elsewhere(self.address, self.reconnect_timeout, self.dataset,
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
