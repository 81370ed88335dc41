"""The gRPC client: datasets, stats, warming, and batch streams that survive daemon restarts."""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Iterator, List, Optional, Tuple

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


class Batch:
    """One batch. `images` is a read-only uint8 array [B, ...] that shares memory with the
    received message: no copy is made on the way to numpy or torch."""

    __slots__ = ("index", "num_batches", "images", "labels", "sample_ids")

    def __init__(self, msg: "pb.Batch"):
        self.index: int = msg.batch_index
        self.num_batches: int = msg.num_batches
        data = msg.data  # one bytes object; the arrays below are views of it
        self.images: np.ndarray = np.frombuffer(data, dtype=np.uint8).reshape(tuple(msg.shape))
        self.labels: np.ndarray = np.asarray(msg.labels, dtype=np.int64)
        self.sample_ids: np.ndarray = np.asarray(msg.sample_ids, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def torch(self) -> Tuple["torch.Tensor", "torch.Tensor"]:  # noqa: F821
        """(images, labels) as torch tensors. The images tensor shares the message's memory
        (read-only: do not modify it in place; move it to the GPU and convert there)."""
        import torch

        with warnings.catch_warnings():
            # The buffer is immutable bytes; torch warns that it cannot be written to.
            warnings.simplefilter("ignore", UserWarning)
            images = torch.from_numpy(self.images)
        return images, torch.from_numpy(self.labels)


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
    ) -> Iterator[Batch]:
        """The batches of one epoch of rank `rank`'s shard, from `start_batch` on.

        The order is a function of (seed, epoch) only, so if the daemon goes away the stream
        reconnects and asks for the rest, starting at the next batch it has not yielded: every
        sample still comes exactly once.
        """
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
