"""The gRPC client: datasets, stats, warming, and batch streams that survive daemon restarts."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping
from typing import Dict, Iterator, List, Optional, Sequence, Union

import grpc
import numpy as np

from larder.v1 import larder_pb2 as pb
from larder.v1 import larder_pb2_grpc as pb_grpc

log = logging.getLogger("larder")

DEFAULT_ADDRESS = "127.0.0.1:7878"

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


def _field(f: "pb.FieldBatch", n: int):
    """(array or Ragged, lengths or None) of one FieldBatch; arrays share the message's bytes."""
    dtype = np.dtype(f.dtype)
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
    sharing memory with the received message (read-only; no copy on the way to numpy or torch).

    A field whose shape varies by sample comes padded with zeros to the batch's largest value,
    its sizes along the variable dims in `lengths[name]` (int64 [B, variable dims]), or, when
    the stream asked for `variable_layout="offsets"`, as a `Ragged`. `size` is the number of
    samples; `images` and `labels` are the "image" and "label" fields.
    """

    __slots__ = ("index", "num_batches", "sample_ids", "fields", "lengths")

    def __init__(self, msg: "pb.Batch"):
        self.index: int = msg.batch_index
        self.num_batches: int = msg.num_batches
        self.sample_ids: np.ndarray = np.asarray(msg.sample_ids, dtype=np.int64)
        n = len(self.sample_ids)
        self.fields: Dict[str, Union[np.ndarray, Ragged]] = {}
        self.lengths: Dict[str, np.ndarray] = {}
        for f in msg.fields:
            self.fields[f.name], lengths = _field(f, n)
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
    def images(self) -> np.ndarray:
        return self["image"]

    @property
    def labels(self) -> np.ndarray:
        return self["label"]

    def torch(self, fields: Optional[Sequence[str]] = None):
        """The fields as torch tensors sharing this batch's memory (read-only: do not modify them
        in place; move them to the GPU and convert there).

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
    else 127.0.0.1:7878. reconnect_timeout: how long a stream keeps trying to reach a daemon
    that went away before giving up, in seconds.
    """

    def __init__(self, address: Optional[str] = None, reconnect_timeout: float = 60.0):
        self.address = _target(address or os.environ.get("LARDER_ADDR", DEFAULT_ADDRESS))
        self.reconnect_timeout = reconnect_timeout
        options = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
        ]
        if self.address.startswith("unix:"):
            # grpc would send the socket path as :authority, which HTTP/2 servers reject.
            options.append(("grpc.default_authority", "localhost"))
        self._channel = grpc.insecure_channel(self.address, options=options)
        self._stub = pb_grpc.LarderStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request):
        try:
            return method(request)
        except grpc.RpcError as e:
            raise LarderError(f"{e.details()} ({self.address})", e.code()) from None

    def datasets(self) -> List["pb.DatasetInfo"]:
        return list(self._call(self._stub.ListDatasets, pb.ListDatasetsRequest()).datasets)

    def dataset(self, name: str) -> "pb.DatasetInfo":
        for d in self.datasets():
            if d.name == name:
                return d
        raise LarderError(f"unknown dataset {name!r}", grpc.StatusCode.NOT_FOUND)

    def stats(self) -> "pb.Stats":
        return self._call(self._stub.GetStats, pb.GetStatsRequest())

    def warm(self, dataset: str) -> Iterator["pb.WarmProgress"]:
        """Preprocesses `dataset` into the daemon's scratch tier, yielding progress."""
        try:
            yield from self._stub.Warm(pb.WarmRequest(dataset=dataset))
        except grpc.RpcError as e:
            raise LarderError(e.details(), e.code()) from None

    def stream(
        self,
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
        fields: Optional[Sequence[str]] = None,
        variable_layout: str = "padded",
    ) -> Iterator[Batch]:
        """The batches of one epoch of rank `rank`'s shard, from `start_batch` on.

        `fields` picks and orders the fields served (default: all). Fields whose shape varies
        by sample come padded, with lengths (`variable_layout="padded"`), or as values plus
        offsets (`"offsets"`).

        The order is a function of (seed, epoch) only, so if the daemon goes away the stream
        reconnects and asks for the rest, starting at the next batch it has not yielded: every
        sample still comes exactly once.
        """
        layouts = {"padded": pb.PADDED, "offsets": pb.OFFSETS}
        if variable_layout not in layouts:
            raise ValueError(f"variable_layout must be 'padded' or 'offsets', not {variable_layout!r}")
        next_batch = start_batch
        retry_until = None
        delay = 0.05
        while True:
            request = pb.StreamBatchesRequest(
                dataset=dataset,
                batch_size=batch_size,
                seed=seed,
                epoch=epoch,
                rank=rank,
                world_size=world_size,
                start_batch=next_batch,
                sequential=not shuffle,
                drop_last=drop_last,
                fields=list(fields or []),
                variable_layout=layouts[variable_layout],
                layout_version=1,
            )
            call = self._stub.StreamBatches(request)
            try:
                for msg in call:
                    if msg.batch_index != next_batch:
                        raise LarderError(
                            f"expected batch {next_batch} from the daemon, got {msg.batch_index}"
                        )
                    next_batch += 1
                    retry_until, delay = None, 0.05
                    yield Batch(msg)
                return
            except grpc.RpcError as e:
                if e.code() not in _RETRYABLE:
                    raise LarderError(e.details(), e.code()) from None
                now = time.monotonic()
                if retry_until is None:
                    retry_until = now + self.reconnect_timeout
                if now >= retry_until:
                    raise LarderError(
                        f"larderd at {self.address} unreachable for {self.reconnect_timeout:.0f}s: "
                        f"{e.details()}",
                        e.code(),
                    ) from None
                log.warning(
                    "larderd stream interrupted (%s); resuming at batch %d", e.details(), next_batch
                )
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            finally:
                call.cancel()
