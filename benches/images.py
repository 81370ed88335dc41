"""Side by side, in one run on the same files: a folder of JPEGs to a training loop.

    PYTHONPATH=python .venv/bin/python benches/images.py [--larderd target/release/larderd]
        [--images 1500] [--rounds 3] [--epochs 2] [--out benches/results] [--plot]
    PYTHONPATH=python .venv/bin/python benches/images.py --images 130 --rounds 1 --epochs 1 --no-pool   (smoke)

Writes --images JPEGs of 500x375 (photo content: boxes of tests/fixtures/parrots.jpg at random
places and scales, with a little noise, quality 90) in 10 class folders, then measures, with
the files in the page cache, samples/s reaching the loop as uint8 [B, 3, 224, 224] batches of
128 (the loop touches each batch):
  - torchvision eval: ImageFolder with Resize(256) + CenterCrop(224) + PILToTensor (uint8, as
    larder serves it), DataLoader(shuffle=True, num_workers=2, persistent_workers=True);
  - torchvision train: the same with RandomResizedCrop(224) + RandomHorizontalFlip;
  - larder cold epoch: a fresh daemon (empty memory and scratch tiers) and the recommended
    setup (LarderIterableDataset, DataLoader(num_workers=0)), eval pipeline: decoding, resizing
    and delivery in one epoch;
  - `larder warm`: the CLI preprocessing the folder into the scratch tier of another fresh
    daemon;
  - larder warm epochs: the eval pipeline (center crop, no augmentation) and the train
    pipeline (random-resized crop + flip per sample), memory tier warm.
Before and after the rounds (unless --no-pool), `cargo bench --bench pipeline` times the
daemon's preprocessing (decode + resize 256 + planes) of these very files, one after another on
one thread (criterion): the pool of preprocessing threads at full use would do the CPUs this may
run on (the daemon's default thread count) / that time, and the cold epoch is given as a share of it.
With --simd DIR (a folder holding Pillow-SIMD: `CC="cc -mavx2" pip install --no-deps --target DIR
pillow-simd`, which builds from source in about 30 s here), torchvision's eval recipe also runs
with Pillow-SIMD in place of Pillow, in a child process whose `PIL` is DIR's (its DataLoader
workers inherit it): an epoch to start the workers, then the timed one, each round.
torchvision decodes every epoch, so its cold and warm epochs are alike. The machine's speed
drifts (it is shared), so the setups take turns: each of --rounds rounds measures every row once
(torchvision one epoch per recipe, larder a fresh daemon's cold epoch, then --epochs warm epochs
per pipeline, and `larder warm` into another fresh daemon); the table gives each row's median
over the rounds, and ratios to torchvision's eval recipe.

The figures go to --out (see benches/results.py): images.json and images.csv, a row per setup
(its median samples/s, ratio and the rounds' range), with the pool's figures and the train / eval
ratios in the JSON; --plot draws the PNG: the cold epoch against torchvision and the pool's limit.
"""

import argparse
import gc
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import re

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

import results
from larder.torch import LarderIterableDataset

BATCH = 128
REPO = pathlib.Path(__file__).resolve().parents[1]


def write_folder(root: pathlib.Path, n: int, first: int = 0, classes: int = 10) -> int:
    """JPEGs first..first+n of 500x375 in `classes` class folders (the same bytes whichever
    process writes a range); returns their bytes."""
    base = Image.open(REPO / "tests" / "fixtures" / "parrots.jpg").convert("RGB")
    total = 0
    for i in range(first, first + n):
        rng = np.random.default_rng(i)
        w = int(rng.uniform(0.5, 1.0) * base.width)
        h = int(w * 0.75)
        x, y = int(rng.integers(0, base.width - w + 1)), int(rng.integers(0, base.height - min(h, base.height) + 1))
        img = base.crop((x, y, x + w, y + h)).resize((500, 375), Image.BICUBIC)
        px = np.asarray(img).astype(np.int16) + rng.normal(0, 7, (375, 500, 3)).astype(np.int16)
        cls = root / f"c{i % classes}"
        cls.mkdir(parents=True, exist_ok=True)
        path = cls / f"{i:05d}.jpg"
        Image.fromarray(np.clip(px, 0, 255).astype(np.uint8)).save(path, quality=90)
        total += path.stat().st_size
    return total


def epoch_rate(batches) -> float:
    """Samples/s of one pass over `batches` (pairs of images, labels)."""
    t, n = time.perf_counter(), 0
    for images, _ in batches:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 224, 224), images.shape
        int(images.reshape(-1)[0])
        n += images.shape[0]
    return n / (time.perf_counter() - t)


def preprocess_seconds(folder: pathlib.Path) -> float:
    """Criterion's estimate of one thread's preprocessing time per image of `folder`."""
    name = "the folder's JPEGs"
    out = subprocess.run(["cargo", "bench", "--bench", "pipeline", "--", name], cwd=REPO,
                         env={**os.environ, "LARDER_BENCH_JPEGS": str(folder)}, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(re.escape(name) + r"\s+time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]", out.stdout)
    assert m, out.stdout[-2000:]
    scale = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
    return float(m.group(1)) * scale


def median_rate(epochs, batches_of) -> float:
    return float(np.median([epoch_rate(batches_of()) for _ in range(epochs)]))


class Larderd:
    """A fresh larderd (empty scratch tier) serving the folder as "pics"."""

    def __init__(self, binary, tmp: pathlib.Path, name: str, folder: pathlib.Path, budget: int,
                 reader_user: str | None = None):
        """`reader_user`: the config's datasets read by readers as that user (the package's
        setting), else in the daemon's own process."""
        self.dir = tmp / name
        self.dir.mkdir()
        self.socket = self.dir / "larder.sock"
        readers = f'reader_user = "{reader_user}"\n' if reader_user else ""
        (self.dir / "larder.toml").write_text(
            f'unix_socket = "{self.socket}"\n{readers}[scratch]\ndir = "{self.dir / "scratch"}"\n'
            f"[memory]\nbudget_bytes = {budget}\nmessage_bytes = {256 << 20}\n"
            f'[[dataset]]\nname = "pics"\ntcp = true\nkind = "images"\npath = "{folder}"\nresize = 256\ncrop = 224\n'
            "[dataset.train]\n"
            # The same folder as an eval-only dataset (no train pipeline): kept at its eval crop
            # and decoded by region (decode = "region", the default; a build before that keeps
            # it whole).
            f'[[dataset]]\nname = "pics-eval"\nkind = "images"\npath = "{folder}"\nresize = 256\ncrop = 224\n'
        )
        self.log = open(self.dir / "larderd.log", "wb")
        self.proc = subprocess.Popen([binary, "--config", str(self.dir / "larder.toml")], stderr=self.log)
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"larderd did not start; see {self.log.name}")
            time.sleep(0.05)
        self.address = f"unix:{self.socket}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


EVAL_SIMD = "torchvision ImageFolder, eval recipe, Pillow-SIMD"


def simd_epoch(folder: str, simd: str) -> None:
    """The child of --simd: torchvision's eval recipe over `folder` with Pillow-SIMD (the PIL
    in `simd`), an epoch to start the workers and then the timed one; prints its rate."""
    import PIL

    assert pathlib.Path(PIL.__file__).resolve().is_relative_to(pathlib.Path(simd).resolve()), PIL.__file__
    tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()])
    loader = DataLoader(datasets.ImageFolder(folder, transform=tf), batch_size=BATCH, shuffle=True,
                        num_workers=2, persistent_workers=True)
    epoch_rate(loader)
    print(f"rate {epoch_rate(loader)} PIL {PIL.__version__}", flush=True)


def simd_rate(simd: str, folder: pathlib.Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([simd, str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, __file__, "--simd-child", str(folder), simd], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"rate (\S+) PIL (\S+)", out.stdout)
    assert m, out.stdout[-2000:]
    return float(m.group(1))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--simd-child":
        return simd_epoch(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser()
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", "target/release/larderd"))
    p.add_argument("--larder", default=str(REPO / "target" / "release" / "larder"))
    p.add_argument("--images", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--no-pool", action="store_true",
                   help="skip timing the preprocessing of the files with criterion")
    p.add_argument("--simd", default=None,
                   help="a folder holding Pillow-SIMD (pip install --target): torchvision's eval recipe with it too")
    p.add_argument("--before", default=None,
                   help="another larderd binary (a build before a change): its cold epoch too, taking turns")
    p.add_argument("--reader-user", default="nobody" if os.geteuid() == 0 else None,
                   help="the shipped configuration's rows: readers as this user (default, as root: nobody)")
    results.add_options(p)
    args = p.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="larder-images-"))
    os.chmod(tmp, 0o755)  # the readers' user reads the folder
    folder = tmp / "photos"
    disk = write_folder(folder, args.images)
    os.sync()  # no writeback of the new files during the measurements
    for f in folder.rglob("*.jpg"):
        f.read_bytes()  # in the page cache, for every reader alike
    print(f"{args.images} JPEGs of 500x375, {disk / args.images / 1e3:.0f} kB each on average")
    # Every image preprocessed (3x256x341), and the rings the runs open, which count in the
    # budget: two of ten slots of a batch of 3x224x224.
    budget = args.images * 300_000 + 2 * 10 * (BATCH * 3 * 224 * 224 + 8192) + (256 << 20)  # + the message path's share

    pool = [] if args.no_pool else [preprocess_seconds(folder)]
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.PILToTensor()])
    torchvision = {}
    for name, tf in (("torchvision ImageFolder, eval recipe", eval_tf),
                     ("torchvision ImageFolder, train recipe", train_tf)):
        torchvision[name] = DataLoader(datasets.ImageFolder(str(folder), transform=tf), batch_size=BATCH,
                                       shuffle=True, num_workers=2, persistent_workers=True)
        epoch_rate(torchvision[name])  # workers started
    rows = {}

    def add(name, rate):
        rows.setdefault(name, []).append(rate)

    def cold(row, binary, dataset, name, reader_user=None):
        """One cold epoch of `dataset` through a fresh daemon of `binary`."""
        d = Larderd(binary, tmp, name, folder, budget, reader_user=reader_user)
        try:
            ds = LarderIterableDataset(dataset, BATCH, address=d.address, seed=1)
            add(row, epoch_rate(DataLoader(ds, batch_size=None, num_workers=0)))
        finally:
            d.stop()
        shutil.rmtree(d.dir)

    def cold_before(r):
        cold("larder cold epoch, the build before", args.before, "pics", f"before{r}")
        cold("larder cold epoch, eval-only dataset, the build before", args.before, "pics-eval", f"before-eval{r}")

    def cold_shipped(r):
        # As the package ships it: the config's datasets read by readers (reader_user).
        if args.reader_user:
            cold("larder cold epoch, shipped (readers)", args.larderd, "pics", f"shipped{r}", args.reader_user)
            cold("larder cold epoch, shipped (readers), eval-only dataset (region decode)", args.larderd, "pics-eval",
                 f"shipped-eval{r}", args.reader_user)
        cold("larder cold epoch, eval-only dataset (region decode)", args.larderd, "pics-eval", f"eval{r}")

    for r in range(args.rounds):
        for name, loader in torchvision.items():
            add(name, epoch_rate(loader))
        if args.simd:
            add(EVAL_SIMD, simd_rate(args.simd, folder))
        if args.before and r % 2 == 0:
            cold_before(r)
        if r % 2 == 1:
            cold_shipped(r)
        # Cold: one epoch through a fresh daemon, everything decoded on the way; then warm ones.
        d = Larderd(args.larderd, tmp, f"cold{r}", folder, budget)
        try:
            ds = LarderIterableDataset("pics", BATCH, address=d.address, seed=1)
            loader = DataLoader(ds, batch_size=None, num_workers=0)
            add("larder cold epoch (decode + resize + deliver)", epoch_rate(loader))
            add("larder warm epochs, eval (center crop)", median_rate(args.epochs, lambda: loader))
            train = DataLoader(LarderIterableDataset("pics", BATCH, address=d.address, seed=1, pipeline="train"),
                               batch_size=None, num_workers=0)
            add("larder warm epochs, train (random-resized crop + flip)", median_rate(args.epochs, lambda: train))
        finally:
            d.stop()
        shutil.rmtree(d.dir)
        if args.before and r % 2 == 1:
            cold_before(r)
        if r % 2 == 0:
            cold_shipped(r)
        d = Larderd(args.larderd, tmp, f"warm{r}", folder, budget)
        try:
            t = time.perf_counter()
            out = subprocess.run([args.larder, "--addr", d.address, "warm", "pics"], capture_output=True,
                                 text=True)
            assert out.returncode == 0, out.stderr
            add("larder warm (CLI, into the scratch tier)", args.images / (time.perf_counter() - t))
        finally:
            d.stop()
        shutil.rmtree(d.dir)
    del torchvision
    gc.collect()
    if pool:
        pool.append(preprocess_seconds(folder))
    spread = {name: (min(rates), max(rates)) for name, rates in rows.items()}
    rows = {name: float(np.median(rates)) for name, rates in rows.items()}
    order = ["torchvision ImageFolder, eval recipe", "torchvision ImageFolder, train recipe"]
    order += [EVAL_SIMD] if args.simd else []
    rows = {name: rows[name] for name in order + [n for n in rows if n not in order]}

    shutil.rmtree(tmp)

    base = rows["torchvision ImageFolder, eval recipe"]
    print(f"\nsamples/s (median of {args.rounds} rounds) and the ratio to torchvision's eval recipe of the "
          f"same run ({os.cpu_count()} cores)")
    print(f"{'':<58} {'samples/s':>10} {'ratio':>7}   rounds' range")
    for name, rate in rows.items():
        lo, hi = spread[name]
        print(f"{name:<58} {rate:>10.0f} {rate / base:>6.2f}x   {lo:.0f}-{hi:.0f}")
    pool_figures = None
    if pool:
        threads = len(os.sched_getaffinity(0))  # the daemon's default: the CPUs it may run on
        full = threads / float(np.mean(pool))
        cold = rows["larder cold epoch (decode + resize + deliver)"]
        pool_figures = {"seconds_per_image": pool, "threads": threads, "full_per_s": full,
                        "cold_share": cold / full}
        print(f"\npreprocessing on one thread (criterion, these files): "
              f"{' and '.join(f'{t * 1e6:.0f} us' for t in pool)} an image (before and after the rounds); "
              f"the pool at full use: {threads} threads, {full:.0f}/s; "
              f"the cold epoch is {100 * cold / full:.0f}% of it")
    cores = len(os.sched_getaffinity(0))
    cold_per_core = rows["larder cold epoch (decode + resize + deliver)"] / cores
    print(f"\nthe cold epoch per core: {cold_per_core:.0f} images/s ({cores} cores; a 16-core box feeding 8 GPUs "
          "that train ResNet-50 at 3,000 images/s each needs about 1,250)")
    train = rows["larder warm epochs, train (random-resized crop + flip)"]
    print(f"\ntrain / eval, larder warm: {train / rows['larder warm epochs, eval (center crop)']:.2f}; "
          f"larder train / torchvision train: {train / rows['torchvision ImageFolder, train recipe']:.2f}x")
    results.save("images", args, [
        {"setup": name, "samples_per_s": rate, "ratio": rate / base, "rounds_min": spread[name][0],
         "rounds_max": spread[name][1]} for name, rate in rows.items()
    ], pool=pool_figures, image_kb=disk / args.images / 1e3, cold_per_core=cold_per_core,
        train_over_eval=train / rows["larder warm epochs, eval (center crop)"],
        train_over_torchvision_train=train / rows["torchvision ImageFolder, train recipe"])


if __name__ == "__main__":
    main()
