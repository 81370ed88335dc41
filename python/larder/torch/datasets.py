"""torchvision.datasets for a script ported to larder: `ImageFolder(root, transform)` with the
script's own torchvision transforms, served by larderd; every other name is torchvision's.

A script that reads `import torchvision.datasets as datasets` and builds
`datasets.ImageFolder(traindir, transforms.Compose([...]))` and
`torch.utils.data.DataLoader(train_dataset, ...)` changes three lines:

    from larder.torch import datasets, DataLoader      # was: import torchvision.datasets as datasets
    train_loader = DataLoader(                          # was: torch.utils.data.DataLoader(
    val_loader = DataLoader(                            # was: torch.utils.data.DataLoader(

The transforms are read, not run: `RandomResizedCrop` (+ `RandomHorizontalFlip`) is the
daemon's train pipeline, `Resize` + `CenterCrop` its eval pipeline, `ToTensor` (or
`PILToTensor`, `ConvertImageDtype`, v2's `ToImage` + `ToDtype`) and `Normalize` are done on the
batch, on the current CUDA device when there is one. A transform the daemon does not do is
refused with what to do instead, never skipped in silence. The dataset is made when
`DataLoader` names its batch size (the daemon batches); `len()` is its number of images, as
torchvision's.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch

from larder.client import Client
from larder.folders import class_names, own_folder
from larder.torch.dataset import LarderIterableDataset

__all__ = ["ImageFolder", "Recipe", "recipe", "class_names"]


class Recipe:
    """What a torchvision transform pipeline asks of larder: the pipeline ("train": a random
    resized crop, "eval": resize then center crop), its sizes and resampling, and what becomes
    of the uint8 batch (float in [0, 1] or not, normalized or not)."""

    def __init__(self) -> None:
        self.train = False
        self.crop: Optional[int] = None
        self.resize: Optional[int] = None
        self.scale: Optional[Tuple[float, float]] = None
        self.ratio: Optional[Tuple[float, float]] = None
        self.hflip: Optional[bool] = None
        self.interpolation: Optional[str] = None
        self.tensor: Optional[str] = None  # "float" (ToTensor's [0, 1]) or "uint8" (PILToTensor)
        self.normalize: Optional[Tuple[List[float], List[float]]] = None

    def folder_kwargs(self) -> dict:
        """larder.torch.ImageFolder's arguments for the recipe."""
        kwargs: dict = {"train": self.train, "crop": self.crop}
        if self.resize is not None:
            kwargs["resize"] = self.resize
        for name in ("scale", "ratio", "hflip", "interpolation"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.tensor == "float":
            # Float in [0, 1], normalized if asked, on the current CUDA device when there is
            # one: the transfer moves uint8, and the script's own .to(device) finds it there.
            kwargs["dtype"] = torch.float32
            kwargs["device"] = "auto"
            if self.normalize is not None:
                kwargs["normalize"] = self.normalize
        return kwargs

    def __repr__(self) -> str:
        return f"Recipe({self.folder_kwargs()})"


def _square(size, what: str) -> int:
    """An int size from torchvision's int, [int] or (h, w) with h == w."""
    if isinstance(size, int):
        return size
    size = list(size)
    if len(size) == 1 or (len(size) == 2 and size[0] == size[1]):
        return int(size[0])
    raise ValueError(f"{what}({tuple(size)}): larder cuts square crops; give one size")


def _interpolation(mode) -> str:
    value = getattr(mode, "value", mode)
    if value in ("bilinear", "bicubic"):
        return value
    if value in (2, 3):  # PIL's constants, as older scripts pass them
        return {2: "bilinear", 3: "bicubic"}[value]
    raise ValueError(f"interpolation {mode!r}: larder resamples 'bilinear' or 'bicubic'")


def recipe(transform) -> Recipe:
    """Reads a torchvision transform (a `Compose` of the transforms larder does, v1 or v2) into
    a Recipe; raises ValueError naming what larder does not do and where it goes instead."""
    steps = _flatten(transform)
    r = Recipe()
    seen: List[str] = []
    for t in steps:
        name = type(t).__name__
        if name == "RandomResizedCrop":
            _in_order(seen, name, before=("Resize", "CenterCrop", "ToTensor", "Normalize"))
            r.train = True
            r.crop = _square(t.size, name)
            r.scale = tuple(float(x) for x in t.scale)
            r.ratio = tuple(float(x) for x in t.ratio)
            r.interpolation = _interpolation(t.interpolation)
        elif name == "RandomHorizontalFlip":
            if t.p not in (0.0, 0.5):
                raise ValueError(f"RandomHorizontalFlip(p={t.p}): larder flips half the samples (p=0.5)")
            r.hflip = t.p == 0.5
        elif name == "Resize":
            _in_order(seen, name, before=("RandomResizedCrop", "CenterCrop", "ToTensor", "Normalize"))
            r.resize = _square(t.size, name)
            if not isinstance(t.size, int) and len(list(t.size)) == 2:
                raise ValueError(f"Resize({tuple(t.size)}): larder keeps the aspect ratio; give the shorter side")
            if getattr(t, "max_size", None) is not None:
                raise ValueError("Resize(max_size=...): set max_size in the dataset's table (larder add)")
            r.interpolation = _interpolation(t.interpolation)
        elif name == "CenterCrop":
            _in_order(seen, name, before=("ToTensor", "Normalize"))
            r.crop = _square(t.size, name)
        elif name in ("ToTensor",):
            r.tensor = "float"
        elif name in ("PILToTensor", "ToImage"):
            r.tensor = "uint8"
        elif name in ("ConvertImageDtype", "ToDtype"):
            dtype = t.dtype
            if isinstance(dtype, dict):  # v2: per type; an image's, else a plain tensor's, else "others"
                from torchvision import tv_tensors

                dtype = next((dtype[k] for k in (tv_tensors.Image, torch.Tensor, "others") if k in dtype), None)
            if dtype == torch.float32 and (name == "ConvertImageDtype" or getattr(t, "scale", False)):
                r.tensor = "float"
            elif dtype != torch.uint8:
                raise ValueError(f"{name}({dtype}): larder gives uint8, or float32 in [0, 1]")
        elif name == "Normalize":
            if r.tensor != "float":
                raise ValueError("Normalize before ToTensor: larder normalizes float batches in [0, 1]")
            r.normalize = ([float(x) for x in t.mean], [float(x) for x in t.std])
        else:
            raise ValueError(
                f"{name}: larder's daemon does random-resized crops, flips, resizes and center crops; "
                f"apply {name} to each batch in the loop (on the GPU: torchvision.transforms.v2 or "
                "kornia), see the README's 'Which augmentations run where'")
        seen.append(name)
    if r.tensor is None:
        raise ValueError("the transform gives PIL images; larder gives tensors: end it with ToTensor() "
                         "(float in [0, 1]) or PILToTensor() (uint8)")
    if r.train:
        if r.hflip is None:
            r.hflip = False  # no RandomHorizontalFlip: no flips (the daemon's own default flips)
        if r.resize is not None or "CenterCrop" in seen:
            raise ValueError("RandomResizedCrop with Resize or CenterCrop: larder's train pipeline is "
                             "the random-resized crop (and flip) alone")
    else:
        if r.hflip:
            raise ValueError("RandomHorizontalFlip without RandomResizedCrop: larder flips in its train "
                             "pipeline only")
        if r.resize is None or r.crop is None:
            raise ValueError("an eval transform is Resize(shorter side) then CenterCrop(size) for larder")
    return r


def _flatten(transform) -> list:
    if transform is None:
        raise ValueError("ImageFolder without a transform gives PIL images; larder gives tensors: "
                         "pass the script's transforms.Compose([...])")
    inner = getattr(transform, "transforms", None)
    if type(transform).__name__ == "Compose" and inner is not None:
        return [s for t in inner for s in _flatten(t)]
    return [transform]


def _in_order(seen: List[str], name: str, before: Tuple[str, ...]) -> None:
    late = [s for s in seen if s in before]
    if late:
        raise ValueError(f"{name} after {late[0]}: larder reads the usual order (crop or resize, "
                         "then ToTensor, then Normalize)")


class ImageFolder(torch.utils.data.Dataset):
    """`torchvision.datasets.ImageFolder(root, transform)`, served by larderd: the folder is
    added as the caller's own dataset (or found, if an earlier call added it) and streamed with
    the pipeline `transform` describes (see `recipe`). Hand it to `larder.torch.DataLoader` (or
    `larder.torch.loader`) with the script's DataLoader arguments: that makes the stream, at the
    loader's batch size. `len()` is the number of images; `classes` and `class_to_idx` are
    torchvision's. `larder` takes LarderIterableDataset's own arguments (seed, valid,
    even_batches, address, ...)."""

    def __init__(self, root, transform=None, target_transform=None, loader=None, is_valid_file=None,
                 allow_empty: bool = False, *, address: Optional[str] = None, **larder: Any):
        for name, value in (("target_transform", target_transform), ("loader", loader),
                            ("is_valid_file", is_valid_file)):
            if value is not None:
                raise ValueError(f"ImageFolder({name}=...): larder reads the folder itself; apply it to "
                                 "each batch in the loop")
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"Couldn't find the image folder {self.root}")
        self.transform = transform
        self.recipe = recipe(transform)
        self.address = address
        self.larder = larder
        kw = self.recipe.folder_kwargs()
        # The train crop is cut from the image kept at 256 on its shorter side (the README's
        # "random-resized boxes"), or at the crop when that is larger.
        kept = kw.get("resize", max(256, kw["crop"]))
        self.name, _ = own_folder(self.root, resize=kept, crop=kw["crop"], crop_pct=None,
                                  interpolation=kw.get("interpolation"), scale=kw.get("scale"),
                                  ratio=kw.get("ratio"), hflip=kw.get("hflip"), address=address, labels=None)
        self._len: Optional[int] = None
        self._classes: Optional[List[str]] = None

    def stream(self, batch_size: int, shuffle: bool, drop_last: bool = False):
        """The LarderIterableDataset that streams this folder in batches of `batch_size`,
        shuffled or not as the loader asked (its `shuffle`, or its sampler's)."""
        kw = self.recipe.folder_kwargs()
        args = dict(self.larder)
        args.setdefault("shuffle", shuffle)
        args.setdefault("drop_last", drop_last)
        if not args["shuffle"]:
            # Evaluation: every image exactly once (see larder.torch.ImageFolder); a shuffled
            # (training) stream keeps even batch counts, so DDP's all-reduce never waits.
            args.setdefault("even_batches", bool(args.get("valid", False)))
        for name in ("normalize", "device", "dtype"):
            if name in kw:
                args.setdefault(name, kw[name])
        pipeline = "train" if kw["train"] else "eval"
        return LarderIterableDataset(self.name, batch_size, address=self.address, pipeline=pipeline, **args)

    def __len__(self) -> int:
        if self._len is None:
            with Client(self.address) as client:
                self._len = int(client.dataset(self.name).num_samples)
        return self._len

    @property
    def classes(self) -> List[str]:
        if self._classes is None:
            self._classes = class_names(self.root)
        return self._classes

    @property
    def class_to_idx(self) -> dict:
        return {c: i for i, c in enumerate(self.classes)}

    def __getitem__(self, index):
        raise TypeError(
            "a larder ImageFolder is streamed in batches by the daemon: hand it to larder.torch.DataLoader "
            "(from larder.torch import DataLoader), not torch.utils.data.DataLoader")

    def __repr__(self) -> str:
        return f"larder ImageFolder {self.root!r} as {self.name} ({self.recipe})"


def __getattr__(name: str):
    """Every other dataset (FakeData, CIFAR10, ...) is torchvision's own."""
    if name.startswith("__"):  # module machinery (__path__, ...): this is a module, not a package
        raise AttributeError(name)
    try:
        import torchvision.datasets
    except ImportError as e:
        raise AttributeError(f"larder.datasets.{name} is torchvision's, and torchvision is not installed") from e
    return getattr(torchvision.datasets, name)
