"""Which epoch an iteration of a dataset serves, and from where: the clock the training process
and its DataLoader workers share, and the position a dataset's state_dict() records."""

from __future__ import annotations

from typing import Tuple

# DataLoader workers a dataset may have (one epoch counter each, in shared memory).
MAX_WORKERS = 1024


class EpochClock:
    """Which epoch each iteration of a dataset is, seen alike by the training process and its
    DataLoader workers, fresh or persistent: shared memory made with the dataset, inherited by
    forked workers and handed to spawned ones. `set(e, start_sample, start_step)` makes the next
    iteration epoch e from there; each later iteration is the next epoch, from its start. Every
    worker iterates once per epoch, so each counts its own iterations and they agree."""

    def __init__(self, epoch: int, start_sample: int, start_step: int):
        import multiprocessing.sharedctypes as shared

        self._base = shared.RawArray("q", [epoch, start_sample, start_step])
        self._iterations = shared.RawArray("q", MAX_WORKERS)

    def set(self, epoch: int, start_sample: int = 0, start_step: int = 0) -> None:
        self._base[0], self._base[1], self._base[2] = epoch, start_sample, start_step
        for k in range(MAX_WORKERS):
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
        return self._base[0] + max(self._iterations[k] for k in range(MAX_WORKERS))

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


def position(epoch: int, sample: int = 0, step: int = 0, batches: int = 0, *, order: int) -> dict:
    """A dataset's state: an iteration of `epoch` in order form `order` that began at `sample` of
    the epoch's global order and step `step`, has yielded `batches` batches, and stands at
    `sample` (the last batch's resume_sample once it has yielded one)."""
    return {"epoch": epoch, "sample": sample, "base_sample": sample, "base_step": step, "batches": batches,
            "order": order}
