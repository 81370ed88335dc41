"""Lightning: a callback that says, each epoch, whether the job waited for its larder batches.

    trainer = L.Trainer(callbacks=[larder.lightning.InputStats()])

At the end of each training epoch it finds the larder datasets under the trainer's train
dataloader, logs each one's `InputStats` (the share of step time the loop waited for batches,
the verdict, and the daemon's cause and fix when it waited) as one line through `logging`, and
logs `larder/wait_ratio` and `larder/input_bound` (1 or 0) through the LightningModule, so they
reach the trainer's logger (TensorBoard, CSV, ...) like any metric.
"""

from __future__ import annotations

import logging
from typing import Iterator, List

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from larder.torch.dataset import LarderIterableDataset

log = logging.getLogger("larder")


def _datasets(loader) -> Iterator[LarderIterableDataset]:
    """The larder datasets under `loader` (a DataLoader, larder's loader, a CombinedLoader, or
    lists and dicts of them)."""
    if loader is None:
        return
    if isinstance(loader, LarderIterableDataset):
        yield loader
        return
    if isinstance(loader, dict):
        loader = list(loader.values())
    if isinstance(loader, (list, tuple)):
        for x in loader:
            yield from _datasets(x)
        return
    flattened = getattr(loader, "flattened", None)  # Lightning's CombinedLoader
    if flattened is not None and flattened is not loader:
        yield from _datasets(flattened)
        return
    ds = getattr(loader, "dataset", None)
    if isinstance(ds, LarderIterableDataset):
        yield ds
    elif ds is not None and hasattr(ds, "ds") and isinstance(ds.ds, LarderIterableDataset):
        yield ds.ds  # larder.torch.loader's own wrapper


class InputStats(Callback):
    """Logs, every `every_n_epochs` training epochs, whether the job was input-bound (see the
    module's docstring). `metrics=False` keeps it to the log line."""

    def __init__(self, every_n_epochs: int = 1, metrics: bool = True):
        self.every_n_epochs = max(1, every_n_epochs)
        self.metrics = metrics
        # What the last epoch's end found, dataset by dataset (for tests and for the curious).
        self.last: List = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        found = list(dict.fromkeys(_datasets(getattr(trainer, "train_dataloader", None))))
        self.last = [ds.input_stats() for ds in found]
        for stats in self.last:
            if trainer.is_global_zero or trainer.world_size == 1:
                log.info("larder: epoch %d, rank %d: %s%s", trainer.current_epoch, trainer.global_rank, stats,
                         f" {stats.advice}" if stats.advice and stats.verdict == "input-bound" else "")
            if self.metrics:
                pl_module.log("larder/wait_ratio", float(stats.wait_ratio), on_epoch=True, prog_bar=False)
                pl_module.log("larder/input_bound", float(stats.verdict == "input-bound"), on_epoch=True)
