"""What the torch integration says once in the log (or as a warning): a setup that works but
costs speed, or that a script's loop may trip over, with what to do instead."""

from __future__ import annotations

import logging
import multiprocessing.sharedctypes
import warnings

log = logging.getLogger("larder")

# Whether workers were told that batches through them are copied once more: shared memory
# made at import, so forked workers of every epoch (persistent or not) say it once in all.
_WORKERS_WARNED = multiprocessing.sharedctypes.RawValue("b", 0)

_WORKERS_WARNING = (
    "larder: LarderIterableDataset is iterated in DataLoader workers (num_workers=%d): each "
    "batch is pickled from the worker to the training process, a copy the recommended setup "
    "does not make (at 3x224x224 about a sixth of its speed; see the README's delivery table). "
    "The daemon already does what workers would: use DataLoader(ds, batch_size=None, "
    "num_workers=0)."
)

_said = {"sampler": False, "uneven": False}


def warn_workers(info) -> None:
    """Says once, from the first worker, that DataLoader workers cost a copy per batch (`info`:
    torch's get_worker_info(), None outside workers)."""
    if info is None or info.id != 0 or _WORKERS_WARNED.value:
        return
    _WORKERS_WARNED.value = 1
    warnings.warn(_WORKERS_WARNING % info.num_workers, RuntimeWarning, stacklevel=3)


def note_uneven(ds, world: int) -> None:
    """Says once, under DDP, that a dataset serving every sample exactly once
    (`even_batches=False`, the default of `ImageFolder(train=False)`) may give the ranks one
    batch more or less: right for a loop that all-reduces at the end, a hang for one that syncs
    every batch."""
    if _said["uneven"] or world <= 1 or ds.even_batches or ds.drop_last or ds.valid:
        return
    _said["uneven"] = True
    log.warning(
        "larder dataset %s: every sample exactly once over %d ranks (even_batches=False), so ranks may get one "
        "batch more or less. A loop that all-reduces only at the end (pytorch/examples) is exact; one that "
        "syncs every batch (timm's validate, Accelerate's gather_for_metrics, torchmetrics' dist_sync_on_step) "
        "needs valid=True: equal batch counts, the padding marked.", ds.dataset, world)


def note_distributed_sampler(caller) -> None:
    """Says once what to do when a `DistributedSampler` is built over a larder dataset (it asks
    the dataset's len() as it is made; `caller` is the frame that asked): the daemon shards by
    rank itself, so the sampler is only of use to `larder.torch.loader`, which follows its
    `set_epoch` and leaves its order aside; a plain DataLoader refuses a sampler for an
    iterable dataset."""
    if _said["sampler"] or caller.f_code.co_name != "__init__":
        return
    owner = caller.f_locals.get("self")
    if owner is None or not any(c.__name__ == "DistributedSampler" for c in type(owner).__mro__):
        return
    _said["sampler"] = True
    log.warning(
        "DistributedSampler over a larder dataset: larderd shards the epoch by rank itself. Hand the sampler "
        "to larder.torch.loader(ds, sampler=...), which follows its set_epoch() and leaves its order aside, "
        "or drop it; torch.utils.data.DataLoader refuses any sampler for a larder dataset "
        "(\"expected unspecified sampler option\").")
