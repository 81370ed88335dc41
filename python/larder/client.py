"""The gRPC client: datasets, stats, warming, and batch streams that survive daemon restarts."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from typing import Dict, Iterator, List, Optional

import grpc

from larder.addresses import DEFAULT_ADDRESS, grpc_target, unix_path
from larder.batch import Batch, Ragged
from larder.errors import LarderError, answered, unreachable
from larder.inputstats import InputStats, Meter, Metered
from larder.prefetch import StreamState, read_ahead
from larder.request import stream_request
from larder.shm import Ring, RingRefused, open_ring
from larder.tables import toml_table
from larder import version
from larder.v1 import larder_pb2 as pb
from larder.v1 import larder_pb2_grpc as pb_grpc
from larder.wire import RawBatch

# Batch, Ragged, InputStats, LarderError and DEFAULT_ADDRESS are importable from here too, as
# `larder.client.InputStats` and the like.
__all__ = ["Client", "Batch", "Ragged", "InputStats", "LarderError", "DEFAULT_ADDRESS"]

log = logging.getLogger("larder")

# Status codes after which a stream is retried from its next batch: the daemon is restarting,
# unreachable, or went away mid-stream.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)



def _absolute(path) -> str:
    """`path` made absolute, but for a URL (s3://...), which goes as written: the daemon says
    why it reads it or not."""
    path = os.fspath(path)
    return path if re.match(r"^[A-Za-z][A-Za-z0-9+]*://", path) else os.path.abspath(path)

class Client:
    """A connection to larderd.

    address: "host:port", "http://host:port" or "unix:/path/to/socket"; default: $LARDER_ADDR,
    else unix:/run/larder/larder.sock. reconnect_timeout: how long a stream keeps trying to reach a daemon
    that went away before giving up, in seconds.
    """

    def __init__(self, address: Optional[str] = None, reconnect_timeout: float = 60.0, *,
                 job: Optional[str] = None, advice: Optional[bool] = None):
        self.address = grpc_target(address or os.environ.get("LARDER_ADDR", DEFAULT_ADDRESS))
        self.reconnect_timeout = reconnect_timeout
        # The job's name in `larder top` and the metrics: `job`, else $LARDER_JOB, else the
        # script's name and this process's pid.
        self.job = job or os.environ.get("LARDER_JOB") or default_job()
        # Whether a stream that has been input-bound for a while logs the cause and its fix once
        # (default: yes, unless $LARDER_ADVICE is 0).
        self.advice = advice if advice is not None else os.environ.get("LARDER_ADVICE", "1") != "0"
        # How the loop spends its time, per (dataset, rank, worker): kept across the job's
        # epochs (each a stream of its own).
        self._meters: Dict[tuple, Meter] = {}
        options = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            # Batches are megabytes: larger HTTP/2 frames and read-ahead cost less per byte.
            ("grpc.http2.max_frame_size", 16777215),
            ("grpc.http2.lookahead_bytes", 64 << 20),
        ]
        if self.address.startswith("unix:"):
            # grpc would send the socket path as :authority, which HTTP/2 servers reject.
            options.append(("grpc.default_authority", "localhost"))
        self._channel = grpc.insecure_channel(self.address, options=options)
        self._stub = pb_grpc.LarderStub(self._channel)
        # StreamBatches with the messages left as bytes: larder.wire's RawBatch parses them
        # without copying the fields' data.
        self._stream_batches = self._channel.unary_stream(
            "/larder.v1.Larder/StreamBatches",
            request_serializer=pb.StreamBatchesRequest.SerializeToString,
            response_deserializer=RawBatch,
        )
        # Whether the daemon's API version has been compared with this client's (once, at the
        # first call that reaches it).
        self._version_checked = False
        # Shared-memory rings no stream uses now, kept for the next stream.
        self._idle_rings: List[Ring] = []
        self._rings_lock = threading.Lock()

    def close(self) -> None:
        with self._rings_lock:
            for r in self._idle_rings:
                r.close()
            self._idle_rings.clear()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_version(self) -> None:
        """Compares the daemon's API version with this client's, once per client (see
        larder.version): raises when the client is too old for the daemon, warns when the
        daemon is older than the client. An unreachable daemon is left to the call itself."""
        if self._version_checked:
            return
        try:
            info = self._stub.GetInfo(pb.GetInfoRequest(), timeout=30)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                self._version_checked = e.code() != grpc.StatusCode.UNAVAILABLE
                return
            info = None
        self._version_checked = True
        version.check(info, self.address)

    def info(self) -> "pb.DaemonInfo":
        """The daemon's release (`version`), its API version (`api_version`), the oldest client
        API it serves (`min_client_api_version`) and the kinds of source it reads (`kinds`)."""
        return self._call(self._stub.GetInfo, pb.GetInfoRequest())

    def _call(self, method, request):
        try:
            self._check_version()
            return method(request)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and not answered(self._version_checked, e.details()):
                raise LarderError(unreachable(self.address, e.details()), e.code()) from None
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise LarderError(version.unimplemented(self.address, e.details()), e.code()) from None
            raise LarderError(f"{e.details()} ({self.address})", e.code()) from None

    def datasets(self) -> List["pb.DatasetInfo"]:
        return list(self._call(self._stub.ListDatasets, pb.ListDatasetsRequest()).datasets)

    def dataset(self, name: str) -> "pb.DatasetInfo":
        for d in self.datasets():
            if d.name == name:
                return d
        raise LarderError(f"unknown dataset {name!r}", grpc.StatusCode.NOT_FOUND)

    def streams(self) -> "pb.ListStreamsResponse":
        """The streams open now: yours in detail (`streams`: dataset, job, user, pid, rank,
        batches, samples, wait_seconds, wait_ratio, the verdict "input-bound", "balanced" or
        "compute-bound", its cause and advice, where the samples came from lately), other users'
        counted (`others`), and the preprocessing pool's busy share (`pool_busy`)."""
        return self._call(self._stub.ListStreams, pb.ListStreamsRequest())

    def input_stats(self, dataset: Optional[str] = None) -> "InputStats":
        """How this process's loop has spent its time on `dataset`'s batches (the last dataset
        streamed if None): see `InputStats`. Measured in the process that iterates the stream;
        with DataLoader workers that is a worker, not the training loop (use
        `larder.torch.loader`, which starts none)."""
        meters = [m for k, m in list(self._meters.items()) if dataset is None or k[0] == dataset]
        if not meters:
            return InputStats.empty(self.job, dataset or "",
                                    "starting" if unix_path(self.address) is not None else "unknown")
        return max(meters, key=lambda m: m.last_used).stats()

    def stats(self) -> "pb.Stats":
        return self._call(self._stub.GetStats, pb.GetStatsRequest())

    def add_dataset(self, name: str, path, *, replace: bool = False, **table) -> "pb.DatasetInfo":
        """Adds a dataset of your own, named ``USER/NAME`` and kept across daemon restarts,
        whose files the daemon reads with your rights (Unix socket only). `table` holds the
        keys of the config's ``[[dataset]]`` table: ``kind`` ("hdf5", "images", ...; without
        it the daemon reads `path` as the kind it recognises, see :meth:`source_kind`),
        ``samples``, ``labels``, ``resize``, ``crop``, ``train`` (a dict, {} for the
        defaults), ``allow``, ``field`` (a list of dicts)... Returns the dataset as
        :meth:`datasets` lists it (its ``kind`` among the rest); raises :class:`LarderError`
        with why when it does not open."""
        path = _absolute(path)
        request = pb.AddDatasetRequest(name=name, table=toml_table({"path": path, **table}), replace=replace)
        return self._call(self._stub.AddDataset, request).dataset

    def source_kind(self, path) -> str:
        """The kind of source the daemon reads `path` as ("hdf5", "images", ...), looked at with
        your rights: what :meth:`add_dataset` makes of it without a ``kind``. Raises
        :class:`LarderError` with the daemon's reason when no kind it reads recognises it."""
        path = _absolute(path)
        answer = self._call(self._stub.SourceKind, pb.SourceKindRequest(path=path))
        if not answer.kind:
            reason = answer.reason or f"no kind of source recognises {path}"
            kinds = f" (the daemon reads {', '.join(answer.kinds)})" if answer.kinds else ""
            raise LarderError(f"{reason}{kinds}", grpc.StatusCode.FAILED_PRECONDITION)
        return answer.kind

    def remove_dataset(self, name: str) -> None:
        """Removes a dataset you added (``USER/NAME``); open streams finish."""
        self._call(self._stub.RemoveDataset, pb.RemoveDatasetRequest(name=name))

    def warm(self, dataset: str) -> Iterator["pb.WarmProgress"]:
        """Preprocesses `dataset` into the daemon's scratch tier, yielding progress."""
        try:
            yield from self._stub.Warm(pb.WarmRequest(dataset=dataset))
        except grpc.RpcError as e:
            raise LarderError(e.details(), e.code()) from None

    def bad_samples(self, dataset: str = "") -> List["pb.BadSample"]:
        """The samples skipped because their files do not read or decode (of `dataset`, or of
        every dataset): each with `dataset`, `index` and `error`, which names the file."""
        return list(self._call(self._stub.ListBadSamples, pb.ListBadSamplesRequest(dataset=dataset)).samples)

    def plan(self, dataset: str, batch_size: int, **shard) -> "pb.StreamPlan":
        """What `stream(dataset, batch_size, **shard)` would serve, without serving it:
        `num_batches`, `num_samples`, and `slot_bytes` (the shared memory a batch takes; 0
        when a field varies in size). Takes `stream`'s arguments that pick the shard."""
        return self._call(self._stub.PlanStream, stream_request(dataset, batch_size, **shard))

    def stream(
        self,
        dataset: str,
        batch_size: int,
        *,
        transport: str = "auto",
        prefetch: int = 2,
        pin_memory: bool = False,
        **shard,
    ) -> Iterator[Batch]:
        """The batches of one epoch of rank `rank`'s shard (of its DataLoader worker `worker` of
        `num_workers`). `shard`: seed=0, epoch=0, rank=0, world_size=1, worker=0,
        num_workers=1, shuffle=True, drop_last=False, even_batches=True, start_sample=0,
        start_step=0, start_batch=0, fields=None, variable_layout="padded", pipeline="eval",
        nodes=0, node=0, partitions=0, swap=0.0, resumed_nodes=0, resumed_sample=0,
        order_version=2, augment_seed=None, cohort_seed=None, window=0.

        The daemon holds the sharding rule: the epoch's order, from `start_sample` on, is cut
        into batches taken in rounds, one per rank, round t being every rank's step t; a rank's
        workers take its steps in turn from `start_step`. `even_batches` (default) gives every
        rank the same number of batches, padding the last round with samples from the start of
        the order like `DistributedSampler(drop_last=False)`; with `drop_last` a short last
        round is dropped instead. Each batch's `resume_sample` is the `start_sample` that
        resumes the epoch once every rank has taken its step, on any number of ranks or
        workers. `start_batch` skips batches of this stream's own shard.

        `pipeline="train"` cuts each sample with the dataset's random crop and flip (its
        `[dataset.train]` config), drawn from (seed, epoch, sample id): the same epoch gives the
        same bytes wherever it is replayed or resumed, the next epoch new ones. `"eval"`
        (default) cuts the center. A sample whose files do not read or decode is left out of
        its batch (see `bad_samples`), so a batch may hold fewer than `batch_size`.
        `augment_seed` draws the crops and flips from (augment_seed, epoch, sample id) instead:
        jobs of a grid search on one order `seed` share each read and decode and still get
        their own augmentation. `cohort_seed` and `window` (opt-in, one node): jobs of a grid
        search with different seeds read one base order (by `cohort_seed`), each reshuffled
        inside windows of `window` samples by its own `seed`: every sample once an epoch for
        each job, resumable, as uniform as the base, and the jobs read the same samples in each
        window, so one read and decode serves them all. Their orders are not independent.

        `nodes`, `node`: a job over several nodes, each with its own larderd (the client of
        each rank connects to its node's daemon): node `node` (torchrun's GROUP_RANK, Slurm's
        SLURM_NODEID) reads its own part of every epoch, the same part each epoch (the
        dataset's granules dealt once by the seed to `partitions` canonical partitions, 192 by
        default, a multiple of `nodes`; each shuffled within itself every epoch), so its
        daemon's cache keeps serving it; every sample still comes once an epoch over all the
        nodes' ranks, numbered node by node. `swap` (0 to 1): the share of the granules that
        change partition each epoch (a node's part moves by about that much). `start_sample`
        is then a position in the node's part. An epoch begun on another number of nodes goes
        on with `resumed_nodes` (those nodes) and `resumed_sample` (the `resume_sample` they
        reached): each node reads what is left of its partitions, every sample of the epoch
        still once, and `start_sample` counts from there (`partitions` a multiple of both).

        `fields` picks and orders the fields served (default: all). Fields whose shape varies
        by sample come padded, with lengths (`variable_layout="padded"`), or as values plus
        offsets (`"offsets"`).

        `transport`: "shm" has the daemon write batches into shared memory this process maps
        (Unix socket only; fixed-size fields); "bytes" sends them in the gRPC messages; "auto"
        (default) uses shared memory where it can and bytes otherwise. `prefetch` batches are
        kept ready by a background thread, so the training loop does not wait on the socket (0:
        no thread). `pin_memory` registers the shared memory with CUDA, when a GPU is present,
        so copies to the GPU with `non_blocking=True` run asynchronously from it.

        The order is a function of (seed, epoch) only, so if the daemon goes away the stream
        reconnects and asks for the rest, starting at the next batch it has not yielded: every
        sample still comes exactly once. `order_version` names the order's form: 2 (default) is
        computed as it is read, so a stream starts as fast on 10^8 samples as on 10^3; 1 is the
        form of clients before 2 (every seed's order differs between them). A position saved
        to resume an epoch (`resume_sample`) holds in the form it was read in: record each
        batch's `order_version` with it and ask for that form again.

        The iterator times the loop around it (its wait in `next()`, its step between batches),
        tells the daemon about once a second (a small call, its time counted in neither), and
        answers `.stats()` (an `InputStats`; also
        `Client.input_stats(dataset)`, across epochs).
        """
        if transport not in ("auto", "shm", "bytes"):
            raise ValueError(f"transport must be 'auto', 'shm' or 'bytes', not {transport!r}")
        if transport == "shm" and unix_path(self.address) is None:
            raise LarderError("transport='shm' needs the daemon's Unix socket (address unix:/path)")
        request = stream_request(dataset, batch_size, **shard)
        key = (dataset, request.rank, request.worker)
        meter = self._meters.get(key)
        if meter is None:
            # Reports go over the Unix socket only: over TCP the daemon knows no one.
            report = self._stub.ReportInput if unix_path(self.address) is not None else None
            meter = self._meters[key] = Meter(self.job, dataset, report, self.advice)
        return Metered(self._read(request, transport, pin_memory, prefetch), meter)

    def _read(self, request, transport: str, pin_memory: bool, prefetch: int) -> Iterator[Batch]:
        state = StreamState(max(prefetch, 0))
        batches = self._batches(request, transport, pin_memory, state)
        if prefetch <= 0:
            try:
                yield from batches
            finally:
                batches.close()
            return
        yield from read_ahead(batches, prefetch, state)

    def _ring(self, plan: "pb.StreamPlan", transport: str, pin_memory: bool, prefetch: int):
        """A ring for a stream of `plan` (an idle one of this client's if it fits), or None for
        bytes."""
        path = unix_path(self.address)
        if path is None:
            return None
        slot_bytes = plan.slot_bytes
        if slot_bytes == 0:
            if transport == "shm":
                raise LarderError(
                    "transport='shm' needs fields of fixed size; this request has a variable one"
                )
            return None
        # A slot for each batch the daemon assembles ahead, one on its way, the client's
        # read-ahead, the batch the loop holds and the one before it (a GPU copy may still read
        # it): sized to the depths in use, not more (every slot counts against the daemon's
        # memory budget). A daemon that sends no prefetch_batches: prefetch + 8.
        ahead = plan.prefetch_batches
        slots = ahead + 1 + prefetch + 2 if ahead else prefetch + 8
        with self._rings_lock:
            for i, r in enumerate(self._idle_rings):
                if r.slot_bytes >= slot_bytes and r.slots >= slots and not r.closed:
                    ring = self._idle_rings.pop(i)
                    break
            else:
                # None fits: give the idle ones back before asking for a larger one.
                for r in self._idle_rings:
                    r.close()
                self._idle_rings.clear()
                ring = None
        if ring is None:
            try:
                ring = open_ring(path, slots, slot_bytes)
            except RingRefused as e:
                if transport == "shm":
                    raise LarderError(str(e), getattr(grpc.StatusCode, e.code, None)) from None
                log.warning("larderd made no shared-memory ring (%s); batches come in messages", e)
                return None
        if ring is not None and pin_memory and not ring.pin():
            log.info("pin_memory: no GPU here, the ring stays unpinned")
        return ring

    def _stream_plan(self, request: "pb.StreamBatchesRequest", transport: str) -> "pb.StreamPlan":
        """The daemon's plan for a stream's request, straight from the stub: an unreachable
        daemon is retried like a broken stream."""
        try:
            self._check_version()
            return self._stub.PlanStream(request)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        # A daemon older than PlanStream: its batches come in the messages.
        if transport == "shm":
            raise LarderError("transport='shm' needs a larderd that answers PlanStream; this one is older")
        return pb.StreamPlan()

    def _give_back(self, ring: "Ring") -> None:
        with self._rings_lock:
            if not ring.closed:
                self._idle_rings.append(ring)

    def _batches(
        self, request: "pb.StreamBatchesRequest", transport: str, pin_memory: bool, state: StreamState
    ) -> Iterator[Batch]:
        next_batch = request.start_batch
        form = None
        retry_until = None
        delay = 0.05
        want_ring = transport != "bytes"
        ring = None
        # One PlanStream per stream: the plan (the slot size a ring needs) is asked once, before
        # the first StreamBatches, whatever the transport (a request the daemon refuses fails
        # here, with the message StreamBatches would give). It is kept when the stream
        # reconnects to a restarted daemon, which is a new stream on the daemon's side: the
        # request is the same, and so is its slot size, which the new ring is made with (were
        # the restarted daemon's batches larger, it would send them in the messages). It is
        # asked again only while no answer has come (an unreachable daemon is retried).
        plan = None
        try:
            while True:
                try:
                    if plan is None:
                        plan = self._stream_plan(request, transport)
                    if want_ring and ring is None:
                        ring = self._ring(plan, transport, pin_memory, state.prefetch)
                        want_ring = ring is not None
                    request.start_batch = next_batch
                    request.shm_ring = ring.token if ring is not None else b""
                    del request.held_slots[:]
                    if ring is not None:
                        request.held_slots.extend(ring.held)
                    call = self._stream_batches(request)
                    state.call = call
                    if state.stopped:
                        return
                    try:
                        for raw in call:
                            msg = raw.msg
                            if msg.batch_index != next_batch:
                                raise LarderError(
                                    f"expected batch {next_batch} from the daemon, got {msg.batch_index}"
                                )
                            # The epoch goes on in the order form it began in: after a reconnect
                            # to a daemon of another version, the rest is asked for in that form
                            # (daemons before forms send 0 and serve form 1).
                            served = msg.order_version or 1
                            if form is None:
                                form = request.order_version = served
                            elif served != form:
                                raise LarderError(
                                    f"the daemon now serves order form {served} where this epoch began in form "
                                    f"{form} (it was replaced by a version that cannot serve form {form}): the rest "
                                    "of the epoch in another order would repeat some samples and skip others")
                            slot = None
                            if msg.slot:
                                if ring is None:
                                    raise LarderError("larderd sent a batch in a ring this stream does not have")
                                slot = ring.take(msg.slot - 1)
                            next_batch += 1
                            if ring is not None:
                                ring.waiting_for(next_batch)
                            retry_until, delay = None, 0.05
                            yield Batch(raw, slot)
                            del slot
                        return
                    finally:
                        call.cancel()
                except (grpc.RpcError, ConnectionError, FileNotFoundError) as e:
                    if state.stopped:
                        return
                    code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                    details = e.details() if isinstance(e, grpc.RpcError) else str(e)
                    if code not in _RETRYABLE:
                        raise LarderError(details, code) from None
                    if ring is not None:
                        # The daemon went away, and its rings with it: make a new one.
                        ring.close()
                        ring, want_ring = None, True
                    now = time.monotonic()
                    if retry_until is None:
                        retry_until = now + self.reconnect_timeout
                    if now >= retry_until:
                        node = (request.node, request.nodes) if request.nodes > 1 else None
                        raise LarderError(
                            unreachable(self.address, f"for {self.reconnect_timeout:g} s: {details}", node),
                            code,
                        ) from None
                    log.warning("larderd stream interrupted (%s); resuming at batch %d", details, next_batch)
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
        finally:
            if ring is not None:
                self._give_back(ring)


def default_job() -> str:
    """The job's name when none is given: the script's name (the package's, for `python -m`)
    and this process's pid."""
    path = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else ""
    script = os.path.basename(path)
    if script == "__main__.py":  # python -m package
        script = os.path.basename(os.path.dirname(path))
    return f"{script or 'python'}:{os.getpid()}"
