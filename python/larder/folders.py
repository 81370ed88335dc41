"""Datasets of your own named by path: a folder (or a file) a script names is added as the
caller's dataset, once per (path, settings), and found by every later call that names it the
same way (the torch, torchvision and timm ports share this). The daemon says what kind of
source the path is."""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import time
from typing import List, Optional, Tuple

import grpc

from larder.client import Client
from larder.errors import LarderError

# How long a call waits for a dataset another process added to be served (an image folder is
# walked first; a large one on a network file system can take minutes).
SERVED_WITHIN = 900.0


def class_names(root: str) -> List[str]:
    """The class subfolders of an image folder, in label order (torchvision's: sorted)."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir())


def dataset_name(path: str, settings: dict) -> str:
    """A name for the dataset of `path` with `settings`: readable, and one per (path, settings),
    so that two scripts naming the same folder the same way share one dataset (and its cache)."""
    parts = [p for p in os.path.abspath(path).split(os.sep) if p][-2:]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts)).strip("-.")[:40] or "data"
    digest = hashlib.sha256(repr((os.path.abspath(path), sorted(settings.items()))).encode()).hexdigest()[:8]
    return f"{readable}-{digest}"


def own_folder(root, *, resize: int, crop: int, crop_pct: Optional[float] = None,
               interpolation: Optional[str] = None, scale: Optional[Tuple[float, float]] = None,
               ratio: Optional[Tuple[float, float]] = None, hflip: Optional[bool] = None,
               address: Optional[str] = None, labels: Optional[str] = None) -> Tuple[str, str]:
    """(the caller's own dataset of `root` with these settings, its kind as the daemon reads
    `root`: "images", "hdf5", ...): added for the caller (by uid) if no earlier call did, and
    waited for until the daemon serves it. The image settings apply to an image folder,
    `labels` to the others."""
    path = os.path.abspath(os.fspath(root))
    # The caller's own (by uid, not $USER): never another user's dataset of that name.
    user = pwd.getpwuid(os.getuid()).pw_name
    with Client(address) as client:
        kind = client.source_kind(path)
        table: dict = {"kind": kind}
        if kind == "images":
            train_table: dict = {}
            if scale is not None:
                train_table["scale"] = [float(x) for x in scale]
            if ratio is not None:
                train_table["ratio"] = [float(x) for x in ratio]
            if hflip is not None:
                train_table["flip"] = bool(hflip)
            table.update(resize=resize, crop=crop, train=train_table)
            if crop_pct is not None:
                table["crop_pct"] = crop_pct
            if interpolation is not None:
                table["interpolation"] = interpolation
        elif labels is not None:
            table["labels"] = labels
        name = dataset_name(path, table)
        own = f"{user}/{name}"
        if own not in [d.name for d in client.datasets()]:
            try:
                client.add_dataset(name, path, **table)
            except LarderError as e:  # another of the caller's processes added it meanwhile
                if e.code != grpc.StatusCode.ALREADY_EXISTS:
                    raise
        # Another rank's add may still be opening it.
        deadline = time.monotonic() + SERVED_WITHIN
        while own not in [d.name for d in client.datasets()]:
            if time.monotonic() > deadline:
                raise LarderError(f"{own} was added but is not served (see `larder datasets`)")
            time.sleep(0.1)
    return own, kind
