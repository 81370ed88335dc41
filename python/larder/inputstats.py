"""Is the job input-bound? The client times the training loop around each stream's `next()`,
reports the measure to the daemon about once a second, and judges the verdict by the thresholds
the daemon's answer carries (the daemon keeps them: src/insight.rs)."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Iterator, Optional, Tuple

import grpc

from larder.batch import Batch
from larder.v1 import larder_pb2 as pb

log = logging.getLogger("larder")

# How far back the verdict looks, how often the client reports to the daemon, and how long a
# job must have been input-bound before the one log line with the cause and its fix.
WINDOW_SECONDS = 20.0
REPORT_EVERY = 1.0
ADVICE_AFTER = float(os.environ.get("LARDER_ADVICE_AFTER", "30"))

# ReportInput as the client's stub makes it: (request, timeout=seconds) -> the stream as the
# daemon sees it; raises grpc.RpcError.
Report = Callable[..., "pb.StreamInfo"]


def verdict(seconds: float, ratio: float, answer: Optional["pb.StreamInfo"], reporting: bool) -> str:
    """The verdict of a wait ratio measured over `seconds`, by the thresholds of the daemon's
    last `answer`: "starting" before an answer (while one can come: `reporting`) or before a
    second measured, "unknown" where none can come or the daemon reports no thresholds (both
    0.0), else "input-bound", "balanced" or "compute-bound"."""
    if answer is None:
        return "starting" if reporting else "unknown"
    above, below = answer.input_bound_above, answer.compute_bound_below
    if above == 0.0 and below == 0.0:
        return "unknown"
    if seconds < 1.0:
        return "starting"
    if ratio > above:
        return "input-bound"
    if ratio >= below:
        return "balanced"
    return "compute-bound"


class InputStats:
    """Is the job input-bound? Measured by the client around the training loop's `next()`:
    `wait_seconds` is the time the loop waited for a batch, `step_seconds` the time it spent
    between batches (its step: forward, backward, everything else), both since the first
    batch of this dataset in this process. `wait_ratio` is wait / (wait + step) over the last
    20 s (`window_seconds`, spanning epochs).

    `verdict` judges `wait_ratio` by the thresholds the daemon's last answer to the client's
    report carries (the daemon keeps them, and judges `larder top`'s verdicts by them too):
    "input-bound" above the first, "compute-bound" under the second, "balanced" between;
    "starting" before the first answer or before a second of measure; "unknown" where no
    answer can come, which is over TCP (the daemon takes reports on its Unix socket only) and
    from a daemon that does not report its thresholds (they read 0.0) or takes no reports.

    The daemon's side of the last report: `cause` (why batches are late: "raw reads",
    "preprocessing", "scratch reads", "delivery"; empty when not waiting), `advice` (the fix
    that fits it), `tiers` (where the stream's samples came from over its last 10 s:
    memory/scratch/raw) and `ready_batches` (assembled ahead of the loop)."""

    __slots__ = ("job", "dataset", "batches", "samples", "wait_seconds", "step_seconds", "wait_ratio",
                 "window_seconds", "verdict", "cause", "advice", "tiers", "ready_batches", "stream_id")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])

    @classmethod
    def empty(cls, job: str, dataset: str, verdict: str = "starting") -> "InputStats":
        return cls(job=job, dataset=dataset, batches=0, samples=0, wait_seconds=0.0, step_seconds=0.0,
                   wait_ratio=0.0, window_seconds=0.0, verdict=verdict, cause="", advice="",
                   tiers={"memory": 0, "scratch": 0, "raw": 0}, ready_batches=0, stream_id=0)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self) -> str:
        cause = f", cause {self.cause!r}" if self.cause else ""
        return (f"InputStats({self.job} on {self.dataset}: {self.verdict}, waited {self.wait_ratio:.0%} of "
                f"the step time over {self.window_seconds:.0f} s{cause}; {self.batches} batches)")


class Meter:
    """How a job's loop spends its time on one dataset's batches, across its epochs; reports to
    the daemon about once a second through `report` (None: no reports, as over TCP, where the
    daemon knows no one and refuses them), and logs the advice once when `advice`."""

    def __init__(self, job: str, dataset: str, report: Optional[Report], advice: bool = True):
        self.job = job
        self.dataset = dataset
        self.report = report
        self.advice = advice
        self.lock = threading.Lock()
        self.batches = self.samples = 0
        self.wait = self.step = 0.0
        # (when, wait, step) per batch over the window, and their sums.
        self.recent: "collections.deque" = collections.deque()
        self.window_wait = self.window_step = 0.0
        self.stream_id = 0
        self.reported = 0.0
        # After a failed report, none for a while; after a refused one (a daemon that takes no
        # reports), none again.
        self.report_failed = report is None
        self.quiet_until = 0.0
        self.answer: Optional["pb.StreamInfo"] = None
        self.bound_since: Optional[float] = None
        self.advised = False
        self.last_used = time.monotonic()

    def record(self, wait: float, step: float, batch: Batch) -> None:
        now = time.monotonic()
        with self.lock:
            self.last_used = now
            self.batches += 1
            self.samples += batch.size
            self.wait += wait
            self.step += step
            self.recent.append((now, wait, step))
            self.window_wait += wait
            self.window_step += step
            while self.recent and self.recent[0][0] < now - WINDOW_SECONDS:
                _, w, s = self.recent.popleft()
                self.window_wait -= w
                self.window_step -= s
            # A new stream (the next epoch, a reconnection) is reported at its first batch.
            fresh = batch.stream_id != self.stream_id
            if batch.stream_id:
                self.stream_id = batch.stream_id
            due = ((fresh or now - self.reported >= REPORT_EVERY) and self.stream_id and not self.report_failed
                   and now >= self.quiet_until)
            if due:
                self.reported = now
        if due:
            self._report()
        self._advise(now)

    def _report(self) -> None:
        with self.lock:
            request = pb.ReportInputRequest(
                stream_id=self.stream_id, job=self.job, batches=self.batches,
                wait_seconds=self.wait, step_seconds=self.step,
                window_wait_seconds=max(self.window_wait, 0.0), window_step_seconds=max(self.window_step, 0.0))
        # A unary call on the loop's thread, about once a second (a fraction of a millisecond
        # over the Unix socket): nothing left in flight when the process exits. A daemon too busy
        # to answer within 0.2 s is left alone for 10 s.
        try:
            self.answer = self.report(request, timeout=0.2)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.report_failed = True  # a daemon that takes no reports
            elif e.code() != grpc.StatusCode.NOT_FOUND:  # (a stream that just ended)
                self.quiet_until = time.monotonic() + 10.0
        except ValueError:  # the channel is closed
            pass

    def _reporting(self) -> bool:
        """Whether an answer can still come: reports are made (a stream of a daemon that numbers
        its streams, which a first batch tells)."""
        return not self.report_failed and (self.stream_id != 0 or self.batches == 0)

    def _ratio(self) -> Tuple[float, float]:
        total = max(self.window_wait, 0.0) + max(self.window_step, 0.0)
        return total, (max(self.window_wait, 0.0) / total if total > 0 else 0.0)

    def _advise(self, now: float) -> None:
        if not self.advice or self.advised:
            return
        seconds, ratio = self._ratio()
        if verdict(seconds, ratio, self.answer, self._reporting()) != "input-bound":
            self.bound_since = None
            return
        if self.bound_since is None:
            self.bound_since = now
        if now - self.bound_since < ADVICE_AFTER:
            return
        self.advised = True
        answer = self.answer
        cause = f" ({answer.cause})" if answer is not None and answer.cause else ""
        fix = answer.advice if answer is not None and answer.advice else "see `larder top`"
        log.warning("larder: job %s waited for %s's batches %.0f%% of its step time for %.0f s: input-bound%s. %s",
                    self.job, self.dataset, ratio * 100, now - self.bound_since, cause, fix)

    def stats(self) -> InputStats:
        with self.lock:
            seconds, ratio = self._ratio()
            answer = self.answer
            return InputStats(
                job=self.job, dataset=self.dataset, batches=self.batches, samples=self.samples,
                wait_seconds=self.wait, step_seconds=self.step, wait_ratio=ratio, window_seconds=seconds,
                verdict=verdict(seconds, ratio, answer, self._reporting()),
                cause=answer.cause if answer is not None else "",
                advice=answer.advice if answer is not None else "",
                tiers={"memory": answer.memory_samples if answer is not None else 0,
                       "scratch": answer.scratch_samples if answer is not None else 0,
                       "raw": answer.raw_samples if answer is not None else 0},
                ready_batches=answer.ready_batches if answer is not None else 0,
                stream_id=self.stream_id)


class Metered:
    """A stream's batches, timing the loop around them: the time it waits in `next()` and the
    time it spends between two batches (its step). `stats()` says what they add up to."""

    def __init__(self, batches: Iterator[Batch], meter: Meter):
        self._batches = batches
        self._meter = meter
        self._returned: Optional[float] = None

    def __iter__(self) -> "Metered":
        return self

    def __next__(self) -> Batch:
        asked = time.perf_counter()
        batch = next(self._batches)
        got = time.perf_counter()
        # The first batch of a stream has no step before it (an epoch's start follows validation
        # or a checkpoint, which is not the step's).
        step = asked - self._returned if self._returned is not None else 0.0
        self._meter.record(got - asked, step, batch)
        self._returned = time.perf_counter()
        return batch

    def close(self) -> None:
        self._batches.close()

    def stats(self) -> InputStats:
        return self._meter.stats()
