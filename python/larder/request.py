"""The StreamBatches request a stream's arguments make: the one place they are checked and named
as the daemon takes them (Client.stream, Client.plan and the torch dataset use it)."""

from __future__ import annotations

from typing import Optional, Sequence

from larder.v1 import larder_pb2 as pb


def stream_request(
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
    nodes: int = 0,
    node: int = 0,
    partitions: int = 0,
    swap: float = 0.0,
    resumed_nodes: int = 0,
    resumed_sample: int = 0,
    order_version: int = 2,
    augment_seed: Optional[int] = None,
    cohort_seed: Optional[int] = None,
    window: int = 0,
) -> "pb.StreamBatchesRequest":
    """The StreamBatches request for `Client.stream`'s arguments, checked here so that bad ones fail
    before any call (LarderIterableDataset checks them as it is made)."""
    layouts = {"padded": pb.PADDED, "offsets": pb.OFFSETS}
    if variable_layout not in layouts:
        raise ValueError(f"variable_layout must be 'padded' or 'offsets', not {variable_layout!r}")
    if pipeline not in ("eval", "train"):
        raise ValueError(f"pipeline must be 'train' or 'eval', not {pipeline!r}")
    if nodes and not 0 <= node < nodes:
        raise ValueError(f"node must be in 0..{nodes}, not {node}")
    if resumed_nodes and not nodes:
        raise ValueError("resumed_nodes names the nodes an epoch began on: give nodes too")
    if order_version not in (1, 2):
        raise ValueError(f"order_version must be 1 or 2, not {order_version!r}")
    if not 0.0 <= swap <= 1.0:
        raise ValueError(f"swap must be a share from 0 to 1, not {swap}")
    if (cohort_seed is None) != (window == 0):
        raise ValueError("a correlated order names both its window (samples, at least 1) and its cohort_seed")
    if window and order_version != 2:
        raise ValueError("correlated orders are of order form 2: leave order_version at 2")
    extra = {} if augment_seed is None else {"augment_seed": augment_seed}
    if cohort_seed is not None:
        extra.update(cohort_seed=cohort_seed, window=window)
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
        nodes=nodes,
        node=node,
        partitions=partitions,
        swap=swap,
        resumed_nodes=resumed_nodes,
        resumed_sample=resumed_sample,
        order_version=order_version,
        **extra,
    )
