"""`larder.torch.ImageFolder(path, batch_size, ...)`: a folder (or an HDF5 file) named by path,
streamed as a LarderIterableDataset with the recipe given as arguments."""

from __future__ import annotations

from typing import Optional, Tuple

from larder.folders import own_folder
from larder.torch.dataset import LarderIterableDataset


def ImageFolder(
    root,
    batch_size: int,
    *,
    train: bool = True,
    resize: int = 256,
    crop: int = 224,
    crop_pct: Optional[float] = None,
    interpolation: Optional[str] = None,
    scale: Optional[Tuple[float, float]] = None,
    ratio: Optional[Tuple[float, float]] = None,
    hflip: Optional[bool] = None,
    address: Optional[str] = None,
    labels: Optional[str] = None,
    **dataset_kwargs,
) -> LarderIterableDataset:
    """torchvision's `datasets.ImageFolder(root, transform)` as one larder line: the folder (or
    an HDF5 file, with `labels=` its label dataset) is added as a dataset of your own (read with
    your rights, kept across restarts: the README's "Datasets of your own"), or found among
    yours if an earlier call added it, and streamed with the train pipeline (`train=True`: random-resized crop and
    flip, torchvision's `RandomResizedCrop(crop)` recipe) or the eval one (the center `crop` of the
    image resized to `resize` on its shorter side: `Resize(resize)` + `CenterCrop(crop)`). Two
    scripts naming the same folder with the same sizes share one dataset and its cache.
    timm's recipe: `crop_pct=0.95, interpolation="bicubic"` (the image kept at floor(crop /
    crop_pct) on its shorter side, resampled bicubically); the train crop's `scale` and `ratio`
    (torchvision's and timm's `--scale`/`--ratio`) and `hflip` (False: no flips). `dataset_kwargs`
    go to LarderIterableDataset (seed, normalize, device, valid, ...). With `train=False` every
    image comes exactly once under DDP (`even_batches=False`, so ranks may get one batch more or
    less: right for a loop that all-reduces at the end, as pytorch/examples'), unless
    `valid=True` asks for equal batch counts with the padding marked (timm's per-batch
    all-reduce)."""
    full, kind = own_folder(root, resize=resize, crop=crop, crop_pct=crop_pct, interpolation=interpolation,
                            scale=scale, ratio=ratio, hflip=hflip, address=address, labels=labels)
    pipeline = "train" if train and kind == "images" else "eval"
    dataset_kwargs.setdefault("shuffle", train)
    if not train:
        # Evaluation: every image exactly once, so a script's own loop counts right under DDP
        # (its ranks may get one batch more or less); with `valid=True` the ranks get equal
        # batch counts instead, the padding marked (for loops that all-reduce every batch).
        dataset_kwargs.setdefault("even_batches", bool(dataset_kwargs.get("valid", False)))
    return LarderIterableDataset(full, batch_size, address=address, pipeline=pipeline, **dataset_kwargs)
