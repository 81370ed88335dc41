"""A received batch: the fields of a Batch message (or of a shared-memory slot) as numpy arrays
over the bytes they came in, and as torch tensors over the same memory."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Dict, Optional, Sequence, Union

import numpy as np

from larder.v1 import larder_pb2 as pb
from larder.wire import RawBatch


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


def field_arrays(f: "pb.FieldBatch", n: int, slot: Optional[np.ndarray], data=None):
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
                 "padding", "stream_id", "order_version")

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
        # The form of the epoch's order (1 or 2; daemons before forms send 0 and serve 1): a
        # resume state records it, so the rest of the epoch is asked for in the same order.
        self.order_version: int = getattr(msg, "order_version", 0) or 1
        n = len(self.sample_ids)
        self.fields: Dict[str, Union[np.ndarray, Ragged]] = {}
        self.lengths: Dict[str, np.ndarray] = {}
        for f in msg.fields:
            data = (raw, *next(spans)) if raw is not None else None
            self.fields[f.name], lengths = field_arrays(f, n, slot, data)
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
        fields are exactly "image" and "label" gives the tuple (images, labels); any
        other a dict of every field (with `X_lengths` / `X_offsets` entries
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
