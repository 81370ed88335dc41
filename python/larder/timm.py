"""timm's `create_dataset` and `create_loader` for a script ported to larder: image folders served
by larderd, everything else timm's own.

timm's `train.py` ports in one added line, after its `from timm.data import ...`:

    from larder.timm import create_dataset, create_loader

Its calls stay as they are. `create_dataset("", root=..., split=...)` (an image folder, found
the way timm finds a split's folder) defers to `create_loader`, which reads the recipe from
its arguments, as timm's transforms would: `input_size`, `scale`, `ratio`, `hflip`,
`interpolation` become the daemon's train pipeline (random-resized crop and flip), `crop_pct`
and `input_size` its eval pipeline; the batches go through timm's own `PrefetchLoader` (uint8
to the device, normalized there, random erasing by `re_prob`); `color_jitter` (0.4 by default)
is drawn per sample on the device, in torchvision's way; a `FastCollateMixup` collate (train.py's
mixup under the prefetcher) mixes each batch on the device after the prefetcher, as its `Mixup`
would (mixing commutes with normalizing). What larder does not do (AutoAugment/RandAugment,
grayscale and blur, vertical flips, augmentation splits and repeats) is refused with what to do,
never skipped in silence; a `train_interpolation` of "random" (timm's default, bilinear or
bicubic per sample) is served bilinear, said once in the log. The loader starts no worker
processes (the daemon does their work). Evaluation gives every rank the same number of batches,
padding the last round as timm's `OrderedDistributedSampler` does.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

from larder.folders import class_names, own_folder
from larder.torch.dataset import LarderIterableDataset
from larder.torch.loaders import loader as larder_loader

__all__ = ["create_dataset", "create_loader", "ImageFolder", "color_jitter"]

_TRAIN_SPLITS = ("train", "training")
_EVAL_SPLITS = ("val", "valid", "validation", "eval", "evaluation")


class ImageFolder:
    """An image folder for `create_loader` (what `create_dataset` gives for one): the folder,
    whether it trains, and the seed of its order."""

    def __init__(self, root: str, is_training: bool, seed: int):
        self.root = root
        self.is_training = is_training
        self.seed = seed
        # timm's create_loader sets the transform on the dataset; larder's reads its arguments.
        self.transform = None
        self._classes = None
        # The stream create_loader made for it, and an epoch set before that.
        self._stream = None
        self._epoch: Optional[int] = None

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch `epoch` (timm's train.py calls this each epoch when the
        dataset has it)."""
        if self._stream is not None:
            self._stream.set_epoch(epoch)
        else:
            self._epoch = epoch

    @property
    def classes(self):
        if self._classes is None:
            self._classes = class_names(self.root)
        return self._classes

    def __len__(self) -> int:
        if self._stream is None:
            raise TypeError("a larder timm folder has its length once create_loader made its stream")
        return self._stream.epoch_samples(whole=True)

    def __getitem__(self, index):
        raise TypeError("a larder timm ImageFolder is streamed in batches by the daemon: only "
                        "larder.timm.create_loader serves it (not AugMixDataset, the NaFlex loader or a DataLoader)")

    def __repr__(self) -> str:
        return f"larder timm ImageFolder {self.root!r} ({'train' if self.is_training else 'eval'})"


def _split_folder(root: str, split: str) -> str:
    """The folder of `split` under `root`, found as timm finds it (the split's own name, then
    its synonyms), else `root` itself."""
    name = split.split("[")[0]
    if os.path.exists(os.path.join(root, name)):
        return os.path.join(root, name)
    for synonyms in (_TRAIN_SPLITS, _EVAL_SPLITS):
        if name in synonyms:
            for s in synonyms:
                if os.path.exists(os.path.join(root, s)):
                    return os.path.join(root, s)
    return root


def create_dataset(name: str, root: Optional[str] = None, split: str = "validation", search_split: bool = True,
                   class_map=None, load_bytes: bool = False, is_training: bool = False, download: bool = False,
                   batch_size: int = 1, num_samples: Optional[int] = None, seed: int = 42, repeats: int = 0,
                   **kwargs):
    """timm's `create_dataset`: an image folder (a `name` without a "prefix/", as timm reads
    one: "" by default) for larder's `create_loader`; any other kind (hfds/, tfds/, wds/,
    torch/, a .tar file) is timm's own."""
    if "/" in name or root is None or not os.path.isdir(root):  # hfds/, tfds/, wds/, torch/, a .tar
        import timm.data

        return timm.data.create_dataset(name, root=root, split=split, search_split=search_split,
                                        class_map=class_map, load_bytes=load_bytes, is_training=is_training,
                                        download=download, batch_size=batch_size, num_samples=num_samples,
                                        seed=seed, repeats=repeats, **kwargs)
    if kwargs.get("input_img_mode", "RGB") != "RGB":
        raise ValueError(f"create_dataset(input_img_mode={kwargs['input_img_mode']!r}): larder's image folders are RGB")
    for what, value in (("class_map", class_map), ("load_bytes", load_bytes), ("num_samples", num_samples),
                        ("repeats", repeats)):
        if value:
            raise ValueError(f"create_dataset({what}=...): not done by larder's image folders")
    folder = _split_folder(root, split) if search_split else root
    made = ImageFolder(os.path.abspath(folder), is_training, seed)
    try:
        from timm.utils.misc import natural_key
    except ImportError:
        natural_key = None
    if natural_key is not None and sorted(made.classes, key=natural_key) != made.classes:
        _noted(f"larder.timm: {folder}'s classes are labelled in sorted order (torchvision's: '10' before "
               "'2'), not timm's natural order; a checkpoint trained on timm's labels needs its classes remapped")
    return made


def _refuse(what: str, instead: str) -> None:
    raise ValueError(f"create_loader({what}): larder does not do this; {instead}")


_SAID: set = set()


def _noted(message: str) -> None:
    """Logs `message` once per process."""
    if message not in _SAID:
        _SAID.add(message)
        import logging

        logging.getLogger("larder").warning(message)


def create_loader(dataset, input_size, batch_size: int, is_training: bool = False, no_aug: bool = False,
                  re_prob: float = 0.0, re_mode: str = "const", re_count: int = 1, re_split: bool = False,
                  train_crop_mode: Optional[str] = None, scale=None, ratio=None, hflip: float = 0.5,
                  vflip: float = 0.0, color_jitter=0.4, color_jitter_prob: Optional[float] = None,
                  grayscale_prob: float = 0.0, gaussian_blur_prob: float = 0.0, auto_augment: Optional[str] = None,
                  num_aug_repeats: int = 0, num_aug_splits: int = 0, interpolation: str = "bilinear",
                  mean: Sequence[float] = (0.485, 0.456, 0.406), std: Sequence[float] = (0.229, 0.224, 0.225),
                  num_workers: int = 1, distributed: bool = False, crop_pct: Optional[float] = None,
                  crop_mode: Optional[str] = None, crop_border_pixels: Optional[int] = None, collate_fn=None,
                  pin_memory: bool = False, fp16: bool = False, img_dtype: torch.dtype = torch.float32,
                  device=None, use_prefetcher: bool = True, use_multi_epochs_loader: bool = False,
                  persistent_workers: bool = True, worker_seeding: str = "all", **rest):
    """timm's `create_loader`, its arguments as train.py passes them: for a larder image folder
    (`create_dataset`'s), batches from larderd through timm's `PrefetchLoader`, augmented on the
    device as timm's transforms would have on the CPU (see the module's text); any other dataset
    goes to timm's own `create_loader`."""
    if not isinstance(dataset, ImageFolder) and not isinstance(getattr(dataset, "dataset", None), ImageFolder):
        import timm.data

        return timm.data.create_loader(
            dataset, input_size, batch_size, is_training=is_training, no_aug=no_aug, re_prob=re_prob,
            re_mode=re_mode, re_count=re_count, re_split=re_split, train_crop_mode=train_crop_mode, scale=scale,
            ratio=ratio, hflip=hflip, vflip=vflip, color_jitter=color_jitter, color_jitter_prob=color_jitter_prob,
            grayscale_prob=grayscale_prob, gaussian_blur_prob=gaussian_blur_prob, auto_augment=auto_augment,
            num_aug_repeats=num_aug_repeats, num_aug_splits=num_aug_splits, interpolation=interpolation, mean=mean,
            std=std, num_workers=num_workers, distributed=distributed, crop_pct=crop_pct, crop_mode=crop_mode,
            crop_border_pixels=crop_border_pixels, collate_fn=collate_fn, pin_memory=pin_memory, fp16=fp16,
            img_dtype=img_dtype, device=device if device is not None else torch.device("cuda"),
            use_prefetcher=use_prefetcher, use_multi_epochs_loader=use_multi_epochs_loader,
            persistent_workers=persistent_workers, worker_seeding=worker_seeding, **rest)
    if rest.get("input_size_choices") is not None:  # scheduled sizes (the batch_* arguments go with them)
        _refuse("input_size_choices=...", "give one input size and batch size")
    if rest.get("tf_preprocessing"):
        _refuse("tf_preprocessing=True", "use the eval pipeline (crop_pct, interpolation)")
    if re_split:
        _refuse("re_split=True", "random erasing over the whole batch (re_split=False)")
    if isinstance(getattr(dataset, "dataset", None), ImageFolder):
        _refuse("an AugMixDataset (--aug-splits)", "leave --aug-splits at 0")
    size = input_size if isinstance(input_size, int) else tuple(input_size)[-2:]
    if not isinstance(size, int):
        if size[0] != size[1]:
            _refuse(f"input_size={tuple(input_size)}", "larder cuts square crops")
        size = size[0]
    if isinstance(input_size, (tuple, list)) and len(input_size) == 3 and input_size[0] != 3:
        _refuse(f"input_size={tuple(input_size)}", "larder's image folders are RGB")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if fp16:
        img_dtype = torch.float16
    augment = is_training and not no_aug
    jitter = None
    if augment:
        if auto_augment:
            _refuse(f"auto_augment={auto_augment!r}", "run RandAugment/AutoAugment on the device batch "
                    "(torchvision.transforms.v2 per sample), see the README's 'Which augmentations run where'")
        for what, value in (("vflip", vflip), ("grayscale_prob", grayscale_prob),
                            ("gaussian_blur_prob", gaussian_blur_prob), ("num_aug_repeats", num_aug_repeats),
                            ("num_aug_splits", num_aug_splits), ("color_jitter_prob", color_jitter_prob)):
            if value:
                _refuse(f"{what}={value}", "leave it at its default, or apply it on the device batch")
        if train_crop_mode not in (None, "rrc"):
            _refuse(f"train_crop_mode={train_crop_mode!r}", "larder's train crop is the random-resized crop")
        if hflip not in (0, 0.0, 0.5):
            _refuse(f"hflip={hflip}", "larder flips half the samples (0.5) or none (0)")
        if interpolation == "random":
            _noted("larder.timm: train_interpolation 'random' (bilinear or bicubic per sample) is served bilinear; "
                   "pass --train-interpolation bilinear or bicubic to choose")
            interpolation = "bilinear"
        if color_jitter:
            factors = (color_jitter,) * 3 if isinstance(color_jitter, (int, float)) else tuple(color_jitter)
            if len(factors) == 4 and factors[3]:
                _refuse(f"color_jitter={color_jitter} (hue)", "jitter hue on the device batch yourself")
            jitter = tuple(float(f) for f in factors[:3])
            if not any(jitter):
                jitter = None
    if interpolation not in ("bilinear", "bicubic"):
        _refuse(f"interpolation={interpolation!r}", "larder resamples 'bilinear' or 'bicubic'")
    if crop_mode not in (None, "center") or crop_border_pixels:
        _refuse("crop_mode/crop_border_pixels", "larder's eval crop is the center crop")
    half = "half" in str(getattr(collate_fn, "mode", ""))
    mixup = collate_fn if _is_fast_collate_mixup(collate_fn) and not half else None
    if collate_fn is not None and mixup is None:
        _refuse("collate_fn=...", "batches come collated from the daemon; mix them on the device (timm's Mixup)")

    # The size the images are kept at, on their shorter side.
    if augment:  # 256, or the crop when larger: random-resized boxes are cut from it
        resize, kept_pct = max(256, size), None
    elif is_training:  # no_aug: timm resizes the shorter side to the size and cuts its center
        resize, kept_pct = size, None
    else:  # evaluation: crop / crop_pct
        resize, kept_pct = 256, crop_pct if crop_pct is not None else 0.875
    name, _ = own_folder(dataset.root, resize=resize, crop=size, crop_pct=kept_pct, interpolation=interpolation,
                         scale=scale if augment else None, ratio=ratio if augment else None,
                         hflip=hflip == 0.5 if augment else None, address=None, labels=None)
    # Training: shuffled, the last partial batch dropped (timm's drop_last); evaluation: in
    # order, every rank the same number of batches (timm's OrderedDistributedSampler pads too).
    stream = LarderIterableDataset(name, batch_size, seed=dataset.seed, shuffle=is_training,
                                   drop_last=is_training, pipeline="train" if augment else "eval")
    loader = larder_loader(stream, num_workers=num_workers, pin_memory=pin_memory,
                           persistent_workers=persistent_workers and num_workers > 0)
    loader.dataset.origin = dataset
    dataset._stream = stream
    if dataset._epoch is not None:
        stream.set_epoch(dataset._epoch)
    erase = re_prob if augment else 0.0
    if not use_prefetcher:
        # timm's transforms without the prefetcher give float tensors, normalized (and erased).
        return _OnDevice(loader, mean, std, device, img_dtype, jitter, erase, re_mode, re_count, mixup,
                         normalized=False)
    from timm.data.loader import PrefetchLoader

    if jitter is None and mixup is None:
        return PrefetchLoader(loader, mean=mean, std=std, channels=3, device=device, img_dtype=img_dtype,
                              re_prob=erase, re_mode=re_mode, re_count=re_count)
    # timm's order: jitter (per sample), normalize, mixup (in the collate: it commutes with
    # normalizing), erase; the prefetcher normalizes in float32 and the rest follows on the device.
    prefetched = PrefetchLoader(loader, mean=mean, std=std, channels=3, device=device, img_dtype=torch.float32)
    return _OnDevice(prefetched, mean, std, device, img_dtype, jitter, erase, re_mode, re_count, mixup,
                     normalized=True)


def _is_fast_collate_mixup(fn) -> bool:
    try:
        from timm.data import FastCollateMixup
    except ImportError:
        return False
    return isinstance(fn, FastCollateMixup)


class _OnDevice:
    """A loader's batches, augmented on the device: colour jitter (per sample), normalization,
    random erasing, mixup. `normalized`: the batches come normalized (timm's PrefetchLoader), and
    are taken back to [0, 255] for the jitter; else they come as uint8."""

    def __init__(self, loader, mean, std, device, img_dtype, jitter, re_prob, re_mode, re_count, mixup,
                 normalized: bool):
        self.loader = loader
        self.device = device
        self.img_dtype = img_dtype
        self.jitter = jitter
        self.mixup = mixup
        self.normalized = normalized
        self.mean = torch.tensor([m * 255 for m in mean], device=device).view(1, -1, 1, 1)
        self.std = torch.tensor([s * 255 for s in std], device=device).view(1, -1, 1, 1)
        self.erasing = None
        if re_prob > 0:
            from timm.data.random_erasing import RandomErasing

            self.erasing = RandomErasing(probability=re_prob, mode=re_mode, max_count=re_count, device=device)

    def __iter__(self):
        for x, target in self.loader:
            target = target.to(self.device, non_blocking=True)
            if self.normalized:
                x = x.float()
                if self.jitter is not None:  # back to [0, 255] for the jitter
                    x = x * self.std + self.mean
            else:
                x = x.to(self.device, non_blocking=True).float()
            if self.jitter is not None:
                x = color_jitter(x, self.jitter, scale=255.0)
            if self.jitter is not None or not self.normalized:
                x = (x - self.mean) / self.std
            if self.mixup is not None:
                if len(x) % 2:  # a batch short of a bad sample: mixup pairs samples
                    _noted("larder.timm: a batch with an odd number of samples (a bad sample left out) "
                           "loses its last one to mixup, which pairs samples")
                    x, target = x[:-1], target[:-1]
                from timm.data import Mixup

                # What the collate would have done, on the device: mixed when enabled, the
                # targets smoothed either way (Mixup is FastCollateMixup's own base).
                x, target = Mixup.__call__(self.mixup, x, target)
            if self.erasing is not None:
                x = self.erasing(x)
            yield x.to(self.img_dtype), target

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        # sampler, batch_sampler, dataset, ...: the loader's (timm's train.py asks for them).
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def mixup_enabled(self) -> bool:
        return self.mixup is not None and self.mixup.mixup_enabled

    @mixup_enabled.setter
    def mixup_enabled(self, on: bool) -> None:
        if self.mixup is not None:
            self.mixup.mixup_enabled = on


def _grey(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601-2 luma of RGB [B, 3, H, W] as [B, 1, H, W] (torchvision's rgb_to_grayscale)."""
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def color_jitter(x: torch.Tensor, strength: Tuple[float, float, float], scale: float = 1.0,
                 factors: Optional[torch.Tensor] = None, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torchvision's `ColorJitter(brightness, contrast, saturation)` drawn per sample on a float
    batch [B, 3, H, W] in [0, scale]: each sample gets factors uniform in [max(0, 1 - s), 1 + s]
    and the three adjustments in a random order, each clamped to [0, scale], as torchvision's
    adjust_brightness / adjust_contrast / adjust_saturation do. `factors` ([B, 3]) and `order`
    ([B, 3], a permutation of 0..2 per sample) fix the draws (tests)."""
    b = x.shape[0]
    if factors is None:
        lo = torch.tensor([max(0.0, 1 - s) for s in strength], device=x.device)
        hi = torch.tensor([1 + s for s in strength], device=x.device)
        factors = lo + (hi - lo) * torch.rand(b, 3, device=x.device)
        factors = torch.where(torch.tensor(strength, device=x.device) > 0, factors, torch.ones_like(factors))
    if order is None:
        order = torch.argsort(torch.rand(b, 3, device=x.device), dim=1)
    factors = factors.to(x.device, x.dtype)
    order = order.to(x.device)
    for step in range(3):
        op = order[:, step].view(b, 1, 1, 1)
        f = factors.gather(1, order[:, step:step + 1]).view(b, 1, 1, 1)
        grey = _grey(x)
        bright = x * f
        contrast = f * x + (1 - f) * grey.mean(dim=(1, 2, 3), keepdim=True)
        saturate = f * x + (1 - f) * grey
        x = torch.where(op == 0, bright, torch.where(op == 1, contrast, saturate)).clamp_(0, scale)
    return x
