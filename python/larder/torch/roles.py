"""Where a dataset is iterated under Accelerate: found on the call stack, since Accelerate's
wrappers decide which process serves batches and whether they are sharded again."""

from __future__ import annotations

import sys
from typing import Optional, Tuple


def accelerate_role(ds) -> Optional[Tuple[int, int]]:
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
