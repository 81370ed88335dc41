"""What a loop does with a batch's tensors: uint8 images to float on the device, and exact
evaluation counts over the ranks."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


def exact_counts(correct: "torch.Tensor", valid: "torch.Tensor") -> Tuple[int, int]:
    """(correct, total) over every rank, each sample counted once: `correct` is a bool (or
    0/1) tensor per sample of this rank's evaluation batches, `valid` their masks (the
    dataset's `valid=True`), each concatenated over the epoch or given batch by batch and
    summed by the caller. Summed over the ranks when torch.distributed is initialized."""
    counts = torch.stack([(correct.bool() & valid.to(correct.device)).sum(),
                          valid.to(correct.device).sum()]).to(torch.int64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl" and not counts.is_cuda:
            counts = counts.cuda()
        torch.distributed.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def to_float(
    images: torch.Tensor,
    device=None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
) -> torch.Tensor:
    """uint8 [B, C, H, W] -> float32 in [0, 1] on `device` (normalized per channel if mean and
    std are given). The transfer moves uint8, a quarter of the bytes of float32."""
    x = images.to(device, non_blocking=True).float().div_(255.0)
    if mean is not None and std is not None:
        m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        x = x.sub_(m).div_(s)
    return x
