"""What the framework scripts share: their common arguments, a toy model's loss, and a record
of the sample ids each process trains on per epoch (read back from the pixels of conftest's
dataset) for the test to check."""

import argparse
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from conftest import sample_ids  # noqa: E402


def arguments(doc: str, workers: int = 0) -> argparse.ArgumentParser:
    """ADDRESS OUT --workers K --epochs E, and whatever the script adds."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("address")
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=workers)
    p.add_argument("--epochs", type=int, default=2)
    return p


def model() -> torch.nn.Module:
    """A linear classifier of the 2x4x4 samples."""
    return torch.nn.Linear(32, 10)


def loss(net, images, labels):
    return torch.nn.functional.cross_entropy(net(images.reshape(len(images), -1).float() / 255), labels)


class Recorder:
    """Appends (epoch, ids) lines to OUT/ids-<rank>.jsonl."""

    def __init__(self, out: str, rank: int):
        self.path = pathlib.Path(out) / f"ids-{rank}.jsonl"

    def __call__(self, epoch: int, images, labels) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch, "ids": sample_ids(images, labels), "pid": os.getpid()}) + "\n")
