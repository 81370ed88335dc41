"""Just enough of the protobuf wire format to take a received `Batch` apart without copying its
data.

A batch sent in the gRPC message carries each field's bytes (megabytes) in `FieldBatch.data`.
Parsed by protobuf, every one of them would be copied into a new `bytes` object. Instead the
client receives the message as raw bytes (`RawBatch` is the StreamBatches response
deserializer), strips the `data` of each `FieldBatch` out before protobuf parses the rest (names,
dtypes, shapes, lengths: small), and records where each field's data lies in the raw bytes, so
numpy arrays are made straight over them (zero-copy).

The field numbers come from the generated descriptors (`larder.v1.larder_pb2`), so the .proto
stays their one source.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from google.protobuf.descriptor import FieldDescriptor

from larder.v1 import larder_pb2 as pb


def _number(message, name: str, kind: int) -> int:
    """The field number of `message`'s field `name`, checked to be of type `kind` (length-
    delimited on the wire, which is all `strip` takes apart)."""
    field = message.DESCRIPTOR.fields_by_name[name]
    if field.type != kind:
        raise TypeError(f"{message.DESCRIPTOR.full_name}.{name} is no longer of the type larder.wire parses")
    return field.number


# Batch.fields (repeated FieldBatch) and FieldBatch.data (bytes).
BATCH_FIELDS = _number(pb.Batch, "fields", FieldDescriptor.TYPE_MESSAGE)
FIELD_DATA = _number(pb.FieldBatch, "data", FieldDescriptor.TYPE_BYTES)


def varint(buf: bytes, i: int) -> Tuple[int, int]:
    """The varint at buf[i:], and where it ends."""
    result = shift = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def strip(raw: bytes, start: int, end: int, field: int, nested: Optional[int], spans: list) -> bytes:
    """The protobuf message raw[start:end] without its length-delimited field `field` (whose
    spans in raw are appended to `spans`); with `nested`, that field of each submessage
    `nested` is stripped instead, and `spans` gets one entry per submessage: the span of its
    field, or None where it has none."""
    out = bytearray()
    i = start
    while i < end:
        key, j = varint(raw, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, k = varint(raw, j)
        elif wire == 1:
            k = j + 8
        elif wire == 5:
            k = j + 4
        elif wire == 2:
            length, j2 = varint(raw, j)
            k = j2 + length
            if nested is None and number == field:
                spans.append((j2, k))
                i = k
                continue
            if nested is not None and number == nested:
                inner: list = []
                sub = strip(raw, j2, k, field, None, inner)
                spans.append(inner[-1] if inner else None)
                out += raw[i:j] + encode_varint(len(sub)) + sub
                i = k
                continue
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        out += raw[i:k]
        i = k
    return bytes(out)


class RawBatch:
    """A Batch message as received: its bytes (`raw`), the message parsed without the fields'
    data (`msg`, so protobuf copies none of it), and where each field's data lies in `raw`
    (`spans`: a (start, end) per entry of `msg.fields`, in order; (0, 0) for empty data, which
    protobuf leaves out of the message)."""

    __slots__ = ("raw", "msg", "spans")

    def __init__(self, raw: bytes):
        self.raw = raw
        spans: List[Optional[Tuple[int, int]]] = []
        self.msg = pb.Batch.FromString(strip(raw, 0, len(raw), FIELD_DATA, BATCH_FIELDS, spans))
        self.spans: List[Tuple[int, int]] = [s if s is not None else (0, 0) for s in spans]
