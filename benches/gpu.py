"""ResNet-50 training on one GPU, fed by torchvision's ImageFolder and by larder, cold and warm.

    python3 benches/gpu.py --larderd .dev/run-larderd [--images 20000] [--rounds 2] [--out DIR]
    PYTHONPATH=python .venv/bin/python benches/gpu.py --images 64 --rounds 1 --batch 16 \\
        --arch resnet18 --steps 2 --larderd target/release/larderd       (smoke, on a CPU)

Writes --images JPEGs of 500x375 (images.py's photos) in 100 class folders, on every core. Then
the same training loop (ResNet-50, AMP float16 with GradScaler as timm's --amp, channels_last,
SGD, batches of --batch) first on one batch already on the GPU (the loop's ceiling), then, taking
turns for --rounds rounds, two epochs of each setup from empty caches (the page cache dropped,
where root may; a fresh daemon):
  - torchvision: ImageFolder with RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor +
    Normalize, DataLoader(shuffle=True, num_workers=the cores, pin_memory=True,
    persistent_workers=True), `x.cuda(non_blocking=True)` (pytorch/examples' ImageNet recipe);
  - torchvision done carefully: the same, but uint8 through the workers (PILToTensor) and
    `to_float(images, "cuda", mean, std)` on the GPU, as larder's rows do;
  - larder, its recommended setup: the folder as an `images` dataset (resize 256, crop 224; the
    train pipeline's random-resized crop + flip per sample), LarderIterableDataset(
    pipeline="train", pin_memory=True), DataLoader(batch_size=None, num_workers=0), to_float(
    images, "cuda", mean, std), with the folder read in the daemon's own process and, as the
    package ships (`reader_user` set), by readers as `nobody` (--reader-user).
Per epoch: images/s; the GPU's busy share (the CUDA-event time of each step's GPU work, copy
included, over the epoch's wall time; NVML's utilization beside it); the loop's wait share (its
time in `next()` over the wall time; for larder also the input stats' wait ratio).

The figures go to --out (see benches/results.py) as gpu.json and gpu.csv.
"""

import argparse
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import torch
import torchvision
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

import larder
import results
from images import Larderd, write_folder
from larder.torch import LarderIterableDataset, to_float

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def drop_caches() -> bool:
    """Empties the page cache (root only): the epoch reads the JPEGs from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _chunk(job):
    root, first, n = job
    return write_folder(pathlib.Path(root), n, first=first, classes=100)


def write_photos(root: pathlib.Path, n: int) -> int:
    """n JPEGs written by one process per core; returns their bytes."""
    step = max(1, n // (4 * os.cpu_count()))
    jobs = [(str(root), first, min(step, n - first)) for first in range(0, n, step)]
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        return sum(pool.map(_chunk, jobs))


def wait_open(address: str, batch: int) -> float:
    """Seconds until the daemon serves "pics" (it answers UNAVAILABLE while opening it)."""
    t = time.perf_counter()
    with larder.Client(address) as c:
        while True:
            try:
                c.plan("pics", batch)
                return time.perf_counter() - t
            except larder.LarderError as e:
                if "being opened" not in str(e):
                    raise
                time.sleep(0.02)


class Utilization:
    """NVML's GPU utilization sampled every 100 ms while open (None without NVML)."""

    def __init__(self):
        self.samples, self._stop, self._thread = [], threading.Event(), None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:
            self._nvml = None

    def __enter__(self):
        if self._nvml:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.1):
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()

    @property
    def mean(self):
        return float(np.mean(self.samples)) / 100 if self.samples else None


class Trainer:
    """The training loop: one model, optimizer and scaler for every setup."""

    def __init__(self, arch: str, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        torch.backends.cudnn.benchmark = True
        self.model = getattr(torchvision.models, arch)(num_classes=1000).to(device, memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.cuda)
        self.loss = torch.nn.CrossEntropyLoss()

    def step(self, x, y):
        with torch.autocast(self.device.type, dtype=torch.float16 if self.cuda else torch.bfloat16):
            loss = self.loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)  # reads the overflow flag: one sync a step, as in timm
        self.scaler.update()

    def epoch(self, batches, to_device, max_steps=None, stats=None) -> dict:
        """One pass over `batches` (pairs of images, labels) through `to_device` and a step."""
        events, wait, n, steps = [], 0.0, 0, 0
        before = stats() if stats else None
        with Utilization() as util:
            t0 = time.perf_counter()
            it = iter(batches)
            while max_steps is None or steps < max_steps:
                a = time.perf_counter()
                try:
                    images, labels = next(it)
                except StopIteration:
                    break
                wait += time.perf_counter() - a
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                x, y = to_device(images, labels)
                self.step(x, y)
                if self.cuda:
                    end.record()
                    events.append((start, end))
                n += int(labels.shape[0])
                steps += 1
                del images, labels, x, y
            if self.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        del it
        busy = sum(s.elapsed_time(e) for s, e in events) / 1e3 if events else None
        out = {"images": n, "seconds": wall, "images_per_s": n / wall, "wait_share": wait / wall,
               "gpu_busy_share": busy / wall if busy is not None else None, "nvml_utilization": util.mean}
        if stats:
            after = stats()
            dw, ds = after.wait_seconds - before.wait_seconds, after.step_seconds - before.step_seconds
            out["input_stats_wait_ratio"] = dw / (dw + ds) if dw + ds > 0 else None
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", "target/release/larderd"))
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="the DataLoader's (default: the cores)")
    p.add_argument("--steps", type=int, default=None, help="at most this many steps an epoch (smoke runs)")
    p.add_argument("--seconds", type=float, default=330, help="no round starts after this many seconds")
    p.add_argument("--reader-user", default="nobody",
                   help="the readers' user for the shipped configuration's row ('' for none)")
    results.add_options(p)
    args = p.parse_args()
    began = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "none"
    log(f"torch {torch.__version__}, torchvision {torchvision.__version__}, {os.cpu_count()} cores, GPU: {gpu}")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="larder-gpu-"))
    os.chmod(tmp, 0o755)  # the readers' user reads the photos beneath it
    folder = tmp / "photos"
    disk = write_photos(folder, args.images)
    log(f"{args.images} JPEGs of 500x375, {disk / args.images / 1e3:.0f} kB each on average, "
        f"written in {time.perf_counter() - began:.0f} s")

    trainer = Trainer(args.arch, device)
    # The ceiling: the loop on one batch already on the device (after cuDNN's choices).
    x = torch.randint(0, 256, (args.batch, 3, 224, 224), dtype=torch.uint8, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    fixed = [(x, y)] * (args.steps or 40)
    on_device = lambda images, labels: (to_float(images, device, MEAN, STD).contiguous(  # noqa: E731
        memory_format=torch.channels_last), labels)
    trainer.epoch(fixed[:10], on_device)
    ceiling = trainer.epoch(fixed, on_device)
    log(f"ceiling (data on the GPU): {ceiling['images_per_s']:.0f} images/s, "
        f"GPU busy {ceiling['gpu_busy_share'] or 0:.0%}")

    tv_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                transforms.ToTensor(), transforms.Normalize(MEAN, STD)])

    tv_careful_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                        transforms.PILToTensor()])

    def tv_to_device(images, labels):
        return (images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last),
                labels.to(device, non_blocking=True))

    def larder_to_device(images, labels):
        return on_device(images, labels.to(device, non_blocking=True))

    budget = args.images * 300_000 + (2 << 30)
    runs = []

    def record(setup, r, epoch, cold_cache, figures):
        row = {"setup": setup, "round": r, "epoch": epoch, "page_cache_dropped": cold_cache, **figures}
        runs.append(row)
        log(f"{setup} epoch {epoch}: {row['images_per_s']:.0f} images/s, GPU busy "
            f"{(row['gpu_busy_share'] or 0):.0%} (NVML {row['nvml_utilization'] or 0:.0%}), "
            f"loop waits {row['wait_share']:.1%}"
            + (f" (input stats {row['input_stats_wait_ratio']:.1%})" if row.get("input_stats_wait_ratio") is not None
               else ""))

    def torchvision_round(r, careful=False):
        loader = DataLoader(datasets.ImageFolder(str(folder), transform=tv_careful_tf if careful else tv_tf),
                            batch_size=args.batch, shuffle=True, num_workers=args.workers,
                            pin_memory=device.type == "cuda", persistent_workers=True, drop_last=False)
        dropped = drop_caches()
        setup = ("torchvision, uint8 workers, normalized on the GPU" if careful
                 else "torchvision ImageFolder + DataLoader")
        for epoch in (1, 2):
            record(setup, r, epoch, dropped and epoch == 1,
                   trainer.epoch(loader, larder_to_device if careful else tv_to_device, args.steps))
        del loader

    def careful_round(r):
        torchvision_round(r, careful=True)

    def readers_round(r):
        larder_round(r, args.reader_user)

    def larder_round(r, reader_user=None):
        d = Larderd(args.larderd, tmp, f"larder{r}{'r' if reader_user else ''}", folder, budget,
                    reader_user=reader_user)
        try:
            # The cold epoch of a daemon that has opened the folder (listed it and read each
            # JPEG's header, as a daemon started at boot has), its caches empty.
            opened = wait_open(d.address, args.batch)
            log(f"the daemon opened the folder in {opened:.1f} s")
            dropped = drop_caches()
            ds = LarderIterableDataset("pics", args.batch, address=d.address, seed=r, pipeline="train",
                                       pin_memory=device.type == "cuda")
            loader = DataLoader(ds, batch_size=None, num_workers=0)
            for epoch in (1, 2):
                record("larder, readers (shipped), pinned ring" if reader_user
                       else "larder, in the daemon, pinned ring", r, epoch, dropped and epoch == 1,
                       {**trainer.epoch(loader, larder_to_device, args.steps, stats=ds.input_stats),
                        "open_seconds": opened})
            del loader, ds
        except Exception:
            log("the daemon's log ends:\n" + pathlib.Path(d.log.name).read_text(errors="replace")[-3000:])
            raise
        finally:
            d.stop()
            shutil.rmtree(d.dir, ignore_errors=True)

    for r in range(args.rounds):
        if r and time.perf_counter() - began > args.seconds:
            log(f"round {r} not started: {args.seconds:.0f} s have passed")
            break
        turns = [torchvision_round, careful_round, larder_round] + ([readers_round] if args.reader_user else [])
        for run in (turns if r % 2 == 0 else turns[::-1]):
            try:
                run(r)
            except Exception:
                traceback.print_exc()
                log(f"{run.__name__} round {r} failed")
    shutil.rmtree(tmp, ignore_errors=True)

    table = []
    for setup in dict.fromkeys(row["setup"] for row in runs):
        for epoch, which in ((1, "cold"), (2, "warm")):
            rows = [row for row in runs if row["setup"] == setup and row["epoch"] == epoch]
            if not rows:
                continue
            med = {k: float(np.median([row[k] for row in rows if row.get(k) is not None]))
                   for k in ("images_per_s", "gpu_busy_share", "wait_share", "nvml_utilization",
                             "input_stats_wait_ratio") if any(row.get(k) is not None for row in rows)}
            table.append({"setup": setup, "epoch": which, **med, "rounds": len(rows),
                          "images_per_s_min": min(row["images_per_s"] for row in rows),
                          "images_per_s_max": max(row["images_per_s"] for row in rows),
                          "ceiling_share": med["images_per_s"] / ceiling["images_per_s"]})
    print(f"\n{gpu}, {os.cpu_count()} cores, {args.arch}, batch {args.batch}; the loop on data already on "
          f"the GPU: {ceiling['images_per_s']:.0f} images/s. Medians of {args.rounds} rounds.")
    print(f"{'':<50} {'epoch':>5} {'images/s':>9} {'of ceiling':>10} {'GPU busy':>9} {'loop waits':>10}")
    for row in table:
        print(f"{row['setup']:<50} {row['epoch']:>5} {row['images_per_s']:>9.0f} {row['ceiling_share']:>10.0%} "
              f"{row.get('gpu_busy_share', 0):>9.0%} {row['wait_share']:>10.1%}")
    results.save("gpu", args, table, runs=runs, ceiling=ceiling, gpu=gpu, image_kb=disk / args.images / 1e3,
                 torch=torch.__version__, torchvision=torchvision.__version__)


if __name__ == "__main__":
    main()
