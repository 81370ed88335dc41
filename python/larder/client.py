"""The gRPC client: datasets, stats, warming, and batch streams that survive daemon restarts."""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from larder.shm import Ring, RingRefused, open_ring
from larder.v1 import larder_pb2 as pb
from larder.v1 import larder_pb2_grpc as pb_grpc
from larder.wire import RawBatch

log = logging.getLogger("larder")

# The daemon's Unix socket under its systemd unit: where it knows who is asking, and where
# batches come in shared memory. $LARDER_ADDR or `address=` for another ("host:port" for TCP).
DEFAULT_ADDRESS = "unix:/run/larder/larder.sock"


def _unreachable(address: str, details: str) -> str:
    """What to say when no daemon answers at `address`, in words rather than gRPC's."""
    return (
        f"no larder daemon at {address}: is larderd running? (systemctl status larderd; "
        f"set LARDER_ADDR or address= for another address) [{details}]"
    )

# Status codes after which a stream is retried from its next batch: the daemon is restarting,
# unreachable, or went away mid-stream.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


class LarderError(Exception):
    """A request larderd refused or could not serve; the message says why."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


def _target(address: str) -> str:
    """grpc target for "host:port", "http://host:port" or "unix:/path"."""
    for scheme in ("http://", "https://"):
        if address.startswith(scheme):
            return address[len(scheme):].rstrip("/")
    return address


class Ragged:
    """A variable-shape field in the offsets layout: sample i is
    `values[offsets[i]:offsets[i + 1]].reshape(shapes[i])`."""

    __slots__ = ("values", "offsets", "shapes")

    def __init__(self, values: np.ndarray, offsets: np.ndarray, shapes: np.ndarray):
        self.values = values
        self.offsets = offsets
        self.shapes = shapes

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]].reshape(tuple(self.shapes[i]))


def _field(f: "pb.FieldBatch", n: int, slot: Optional[np.ndarray], data=None):
    """(array or Ragged, lengths or None) of one FieldBatch; arrays share the message's bytes
    (`data`: (bytes, start, end) when parsed apart), or the shared-memory slot's when the batch
    came in one."""
    dtype = np.dtype(f.dtype)
    if slot is not None:
        values = slot[f.slot_offset : f.slot_offset + f.slot_bytes].view(dtype)
    elif data is not None:
        raw, start, end = data
        values = np.frombuffer(raw, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start)
    else:
        values = np.frombuffer(f.data, dtype=dtype)
    template = list(f.sample_shape)
    variable = [i for i, d in enumerate(template) if d < 0]
    if not variable:
        return values.reshape(tuple(f.shape)), None
    lengths = np.asarray(f.lengths, dtype=np.int64).reshape(n, len(variable))
    if f.offsets:
        shapes = np.tile(np.asarray(template, dtype=np.int64), (n, 1))
        shapes[:, variable] = lengths
        return Ragged(values, np.asarray(f.offsets, dtype=np.int64), shapes), lengths
    return values.reshape(tuple(f.shape)), lengths


class Batch(Mapping):
    """One batch: a mapping from field name to a numpy array [B, ...] of the field's stored dtype,
    sharing memory with the shared-memory slot the daemon wrote it into (writable; the slot is
    this process's until every array and tensor made from the batch is gone) or with the
    received message (read-only). No copy on the way to numpy or torch.

    A field whose shape varies by sample comes padded with zeros to the batch's largest value,
    its sizes along the variable dims in `lengths[name]` (int64 [B, variable dims]), or, when
    the stream asked for `variable_layout="offsets"`, as a `Ragged`. `size` is the number of
    samples; `images` and `labels` are the "image" and "label" fields.
    """

    __slots__ = ("index", "num_batches", "step", "resume_sample", "sample_ids", "fields", "lengths",
                 "padding", "stream_id")

    def __init__(self, msg: "Union[pb.Batch, RawBatch]", slot: Optional[np.ndarray] = None):
        raw = None
        if isinstance(msg, RawBatch):
            raw, spans, msg = msg.raw, iter(msg.spans), msg.msg
        self.index: int = msg.batch_index
        self.num_batches: int = msg.num_batches
        # The rank's step this batch is, and where the job stands in the epoch's order once
        # every rank has taken it (start_sample resumes there, on any number of ranks).
        self.step: int = msg.step
        self.resume_sample: int = msg.resume_sample
        self.sample_ids: np.ndarray = np.asarray(msg.sample_ids, dtype=np.int64)
        # The last `padding` samples repeat samples from the start of the epoch's order, so that
        # every rank gets as many batches (even_batches): count them out of evaluation metrics
        # (`valid`). Daemons before this field send 0.
        self.padding: int = getattr(msg, "padding", 0)
        # The stream's id in the daemon (`larder top`, `Client.streams()`; 0 from older ones).
        self.stream_id: int = getattr(msg, "stream_id", 0)
        n = len(self.sample_ids)
        self.fields: Dict[str, Union[np.ndarray, Ragged]] = {}
        self.lengths: Dict[str, np.ndarray] = {}
        for f in msg.fields:
            data = (raw, *next(spans)) if raw is not None else None
            self.fields[f.name], lengths = _field(f, n, slot, data)
            if lengths is not None:
                self.lengths[f.name] = lengths

    def __getitem__(self, name: str):
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(f"no field {name!r}; this batch has {', '.join(self.fields)}") from None

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def size(self) -> int:
        """Samples in the batch."""
        return len(self.sample_ids)

    @property
    def valid(self) -> np.ndarray:
        """bool [size]: False for the padding samples at the batch's end (see `padding`): an
        evaluation that counts `valid` samples only counts every sample of the epoch exactly
        once across all ranks, while every rank still gets the same number of batches."""
        mask = np.ones(len(self.sample_ids), dtype=bool)
        if self.padding:
            mask[len(mask) - self.padding:] = False
        return mask

    @property
    def images(self) -> np.ndarray:
        return self["image"]

    @property
    def labels(self) -> np.ndarray:
        return self["label"]

    def torch(self, fields: Optional[Sequence[str]] = None):
        """The fields as torch tensors sharing this batch's memory (move them to the GPU and
        convert there; a batch that came in the message is read-only).

        With `fields`, a tuple of those fields in that order; a name `X_lengths` (or
        `X_offsets`) gives a variable field's lengths (or offsets). Without, a dataset whose
        fields are exactly "image" and "label" gives the tuple (images, labels), as before
        typed fields; any other a dict of every field (with `X_lengths` / `X_offsets` entries
        for variable fields).
        """
        import torch

        def tensor(a: np.ndarray):
            with warnings.catch_warnings():
                # The buffer is immutable bytes; torch warns that it cannot be written to.
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)

        out = {}
        for name, v in self.fields.items():
            if isinstance(v, Ragged):
                out[name] = tensor(v.values)
                out[name + "_offsets"] = tensor(v.offsets)
            else:
                out[name] = tensor(v)
            if name in self.lengths:
                out[name + "_lengths"] = tensor(self.lengths[name])
        if fields is not None:
            missing = [f for f in fields if f not in out]
            if missing:
                raise KeyError(f"no field {missing[0]!r}; this batch has {', '.join(out)}")
            return tuple(out[f] for f in fields)
        if list(self.fields) == ["image", "label"]:
            return out["image"], out["label"]
        return out


class Client:
    """A connection to larderd.

    address: "host:port", "http://host:port" or "unix:/path/to/socket"; default: $LARDER_ADDR,
    else unix:/run/larder/larder.sock. reconnect_timeout: how long a stream keeps trying to reach a daemon
    that went away before giving up, in seconds.
    """

    def __init__(self, address: Optional[str] = None, reconnect_timeout: float = 60.0, *,
                 job: Optional[str] = None, advice: Optional[bool] = None):
        self.address = _target(address or os.environ.get("LARDER_ADDR", DEFAULT_ADDRESS))
        self.reconnect_timeout = reconnect_timeout
        # The job's name in `larder top` and the metrics: `job`, else $LARDER_JOB, else the
        # script's name and this process's pid.
        self.job = job or os.environ.get("LARDER_JOB") or _default_job()
        # Whether a stream that has been input-bound for a while logs the cause and its fix once
        # (default: yes, unless $LARDER_ADVICE is 0).
        self.advice = advice if advice is not None else os.environ.get("LARDER_ADVICE", "1") != "0"
        # How the loop spends its time, per (dataset, rank, worker): kept across the job's
        # epochs (each a stream of its own).
        self._meters: Dict[tuple, "_Meter"] = {}
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

    def _call(self, method, request):
        try:
            return method(request)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise LarderError(_unreachable(self.address, e.details()), e.code()) from None
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
            return InputStats.empty(self.job, dataset or "")
        return max(meters, key=lambda m: m.last_used).stats()

    def stats(self) -> "pb.Stats":
        return self._call(self._stub.GetStats, pb.GetStatsRequest())

    def add_dataset(self, name: str, path, *, replace: bool = False, **table) -> "pb.DatasetInfo":
        """Adds a dataset of your own, named ``USER/NAME`` and kept across daemon restarts,
        whose files the daemon reads with your rights (Unix socket only). `table` holds the
        keys of the config's ``[[dataset]]`` table: ``kind`` ("hdf5" or "images"; default by
        what `path` is), ``samples``, ``labels``, ``resize``, ``crop``, ``train`` (a dict, {}
        for the defaults), ``allow``, ``field`` (a list of dicts)... Returns the dataset as
        :meth:`datasets` lists it; raises :class:`LarderError` with why when it does not
        open."""
        path = os.path.abspath(os.fspath(path))
        table.setdefault("kind", "images" if os.path.isdir(path) else "hdf5")
        request = pb.AddDatasetRequest(name=name, table=_toml({"path": path, **table}), replace=replace)
        return self._call(self._stub.AddDataset, request).dataset

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
        return self._call(self._stub.PlanStream, _request(dataset, batch_size, **shard))

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
        start_step=0, start_batch=0, fields=None, variable_layout="padded", pipeline="eval".

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
        sample still comes exactly once.

        The iterator times the loop around it (its wait in `next()`, its step between batches),
        tells the daemon about once a second (a small call, its time counted in neither), and
        answers `.stats()` (an `InputStats`; also
        `Client.input_stats(dataset)`, across epochs).
        """
        if transport not in ("auto", "shm", "bytes"):
            raise ValueError(f"transport must be 'auto', 'shm' or 'bytes', not {transport!r}")
        if transport == "shm" and _unix_path(self.address) is None:
            raise LarderError("transport='shm' needs the daemon's Unix socket (address unix:/path)")
        request = _request(dataset, batch_size, **shard)
        key = (dataset, request.rank, request.worker)
        meter = self._meters.get(key)
        if meter is None:
            meter = self._meters[key] = _Meter(self, dataset)
        return _Metered(self._read(request, transport, pin_memory, prefetch), meter)

    def _read(self, request, transport: str, pin_memory: bool, prefetch: int) -> Iterator[Batch]:
        state = _StreamState(max(prefetch, 0))
        batches = self._batches(request, transport, pin_memory, state)
        if prefetch <= 0:
            try:
                yield from batches
            finally:
                batches.close()
            return
        yield from _in_background(batches, prefetch, state)

    def _ring(self, plan: "pb.StreamPlan", transport: str, pin_memory: bool, prefetch: int):
        """A ring for a stream of `plan` (an idle one of this client's if it fits), or None for
        bytes."""
        path = _unix_path(self.address)
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
        # memory budget). Daemons before StreamPlan.prefetch_batches: as before.
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
        self, request: "pb.StreamBatchesRequest", transport: str, pin_memory: bool, state: "_StreamState"
    ) -> Iterator[Batch]:
        next_batch = request.start_batch
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
                        raise LarderError(
                            _unreachable(self.address, f"for {self.reconnect_timeout:g} s: {details}"),
                            code,
                        ) from None
                    log.warning("larderd stream interrupted (%s); resuming at batch %d", details, next_batch)
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
        finally:
            if ring is not None:
                self._give_back(ring)


def _request(
    dataset: str,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    start_batch: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    even_batches: bool = True,
    worker: int = 0,
    num_workers: int = 1,
    start_sample: int = 0,
    start_step: int = 0,
    fields: Optional[Sequence[str]] = None,
    variable_layout: str = "padded",
    pipeline: str = "eval",
) -> "pb.StreamBatchesRequest":
    """The StreamBatches request for `Client.stream`'s arguments."""
    layouts = {"padded": pb.PADDED, "offsets": pb.OFFSETS}
    if variable_layout not in layouts:
        raise ValueError(f"variable_layout must be 'padded' or 'offsets', not {variable_layout!r}")
    if pipeline not in ("eval", "train"):
        raise ValueError(f"pipeline must be 'train' or 'eval', not {pipeline!r}")
    return pb.StreamBatchesRequest(
        dataset=dataset,
        batch_size=batch_size,
        seed=seed,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        start_batch=start_batch,
        sequential=not shuffle,
        drop_last=drop_last,
        even_batches=even_batches,
        worker=worker,
        num_workers=num_workers,
        start_sample=start_sample,
        start_step=start_step,
        fields=list(fields or []),
        variable_layout=layouts[variable_layout],
        layout_version=1,
        pipeline=pipeline,
    )


def _toml_string(s: str) -> str:
    # A JSON string is a TOML basic string once DEL is escaped too (and no surrogate pairs:
    # characters are written as themselves).
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        return repr(float(v))
    if isinstance(v, (str, os.PathLike)):
        path = os.fspath(v)
        return _toml_string(path if isinstance(path, str) else os.fsdecode(path))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"{v!r} is not a value of a dataset's table")


def _toml(table: dict) -> str:
    """`table` as TOML (inline tables for nested ones: the daemon parses any TOML)."""
    return "".join(f"{_toml_string(k)} = {_toml_value(v)}\n" for k, v in table.items())


def _unix_path(address: str) -> Optional[str]:
    """The socket path of a "unix:" address, else None."""
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if address.startswith("unix:"):
        return address[len("unix:"):]
    return None


class _StreamState:
    """What the consumer of a stream shares with the thread that reads it."""

    def __init__(self, prefetch: int = 2):
        self.prefetch = prefetch
        self.call = None
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        call = self.call
        if call is not None:
            call.cancel()


_DONE = object()


def _in_background(batches: Iterator[Batch], depth: int, state: _StreamState) -> Iterator[Batch]:
    """Yields `batches`, read ahead by up to `depth` in a background thread."""
    state.prefetch = depth
    q: "queue.Queue" = queue.Queue(maxsize=depth)

    def put(item) -> bool:
        while not state.stopped:
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def run() -> None:
        try:
            for b in batches:
                if not put((None, b)):
                    return
                del b
            put((None, _DONE))
        except BaseException as e:  # handed to the consumer
            put((e, None))
        finally:
            batches.close()

    thread = threading.Thread(target=run, name="larder-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            err, item = q.get()
            if err is not None:
                raise err
            if item is _DONE:
                return
            yield item
            item = None
    finally:
        state.stop()
        while thread.is_alive():
            try:
                q.get(timeout=0.05)  # let the reader go, and the slots of unread batches
            except queue.Empty:
                pass
        thread.join()


def _default_job() -> str:
    import sys

    path = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else ""
    script = os.path.basename(path)
    if script == "__main__.py":  # python -m package
        script = os.path.basename(os.path.dirname(path))
    return f"{script or 'python'}:{os.getpid()}"


# The client's thresholds, as the daemon's (src/insight.rs): above INPUT_BOUND of the step
# time waiting for batches, a job is input-bound; under COMPUTE_BOUND, compute-bound.
INPUT_BOUND = 0.20
COMPUTE_BOUND = 0.05
# How far back the verdict looks, how often the client reports to the daemon, and how long a
# job must have been input-bound before the one log line with the cause and its fix.
WINDOW_SECONDS = 20.0
REPORT_EVERY = 1.0
ADVICE_AFTER = float(os.environ.get("LARDER_ADVICE_AFTER", "30"))


def _verdict(seconds: float, ratio: float) -> str:
    if seconds < 1.0:
        return "starting"
    if ratio > INPUT_BOUND:
        return "input-bound"
    if ratio >= COMPUTE_BOUND:
        return "balanced"
    return "compute-bound"


class InputStats:
    """Is the job input-bound? Measured by the client around the training loop's `next()`:
    `wait_seconds` is the time the loop waited for a batch, `step_seconds` the time it spent
    between batches (its step: forward, backward, everything else), both since the first
    batch of this dataset in this process. `wait_ratio` is wait / (wait + step) over the last
    20 s (`window_seconds`, spanning epochs), and `verdict` follows from it: "input-bound"
    above 20%, "balanced" from 5%, "compute-bound" under 5% ("starting" before a second of
    it). The daemon's side of the last report: `cause` (why batches are late: "raw reads",
    "preprocessing", "scratch reads", "delivery"; empty when not waiting), `advice` (the fix
    that fits it), `tiers` (where the stream's samples came from over its last 10 s:
    memory/scratch/raw) and `ready_batches` (assembled ahead of the loop)."""

    __slots__ = ("job", "dataset", "batches", "samples", "wait_seconds", "step_seconds", "wait_ratio",
                 "window_seconds", "verdict", "cause", "advice", "tiers", "ready_batches", "stream_id")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])

    @classmethod
    def empty(cls, job: str, dataset: str) -> "InputStats":
        return cls(job=job, dataset=dataset, batches=0, samples=0, wait_seconds=0.0, step_seconds=0.0,
                   wait_ratio=0.0, window_seconds=0.0, verdict="starting", cause="", advice="",
                   tiers={"memory": 0, "scratch": 0, "raw": 0}, ready_batches=0, stream_id=0)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self) -> str:
        cause = f", cause {self.cause!r}" if self.cause else ""
        return (f"InputStats({self.job} on {self.dataset}: {self.verdict}, waited {self.wait_ratio:.0%} of "
                f"the step time over {self.window_seconds:.0f} s{cause}; {self.batches} batches)")


class _Meter:
    """How a job's loop spends its time on one dataset's batches, across its epochs; reports to
    the daemon about once a second, and logs the advice once."""

    def __init__(self, client: "Client", dataset: str):
        self.client = client
        self.dataset = dataset
        self.lock = threading.Lock()
        self.batches = self.samples = 0
        self.wait = self.step = 0.0
        # (when, wait, step) per batch over the window, and their sums.
        self.recent: "collections.deque" = collections.deque()
        self.window_wait = self.window_step = 0.0
        self.stream_id = 0
        self.reported = 0.0
        # Reports go only over the Unix socket (over TCP the daemon knows no one, and refuses
        # them); after a failed one, none for a while.
        self.report_failed = _unix_path(client.address) is None
        self.quiet_until = 0.0
        self.answer: Optional["pb.StreamInfo"] = None
        self.bound_since: Optional[float] = None
        self.advised = False
        self.last_used = time.monotonic()

    def record(self, wait: float, step: float, batch: "Batch") -> None:
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
                stream_id=self.stream_id, job=self.client.job, batches=self.batches,
                wait_seconds=self.wait, step_seconds=self.step,
                window_wait_seconds=max(self.window_wait, 0.0), window_step_seconds=max(self.window_step, 0.0))
        # A unary call on the loop's thread, about once a second (a fraction of a millisecond
        # over the Unix socket): nothing left in flight when the process exits. A daemon too busy
        # to answer within 0.2 s is left alone for 10 s.
        try:
            self.answer = self.client._stub.ReportInput(request, timeout=0.2)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.report_failed = True  # a daemon older than ReportInput
            elif e.code() != grpc.StatusCode.NOT_FOUND:  # (a stream that just ended)
                self.quiet_until = time.monotonic() + 10.0
        except ValueError:  # the channel is closed
            pass

    def _ratio(self) -> Tuple[float, float]:
        total = max(self.window_wait, 0.0) + max(self.window_step, 0.0)
        return total, (max(self.window_wait, 0.0) / total if total > 0 else 0.0)

    def _advise(self, now: float) -> None:
        if not self.client.advice or self.advised:
            return
        seconds, ratio = self._ratio()
        if _verdict(seconds, ratio) != "input-bound":
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
                    self.client.job, self.dataset, ratio * 100, now - self.bound_since, cause, fix)

    def stats(self) -> InputStats:
        with self.lock:
            seconds, ratio = self._ratio()
            answer = self.answer
            return InputStats(
                job=self.client.job, dataset=self.dataset, batches=self.batches, samples=self.samples,
                wait_seconds=self.wait, step_seconds=self.step, wait_ratio=ratio, window_seconds=seconds,
                verdict=_verdict(seconds, ratio),
                cause=answer.cause if answer is not None else "",
                advice=answer.advice if answer is not None else "",
                tiers={"memory": answer.memory_samples if answer is not None else 0,
                       "scratch": answer.scratch_samples if answer is not None else 0,
                       "raw": answer.raw_samples if answer is not None else 0},
                ready_batches=answer.ready_batches if answer is not None else 0,
                stream_id=self.stream_id)


class _Metered:
    """A stream's batches, timing the loop around them: the time it waits in `next()` and the
    time it spends between two batches (its step). `stats()` says what they add up to."""

    def __init__(self, batches: Iterator[Batch], meter: _Meter):
        self._batches = batches
        self._meter = meter
        self._returned: Optional[float] = None

    def __iter__(self) -> "_Metered":
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
