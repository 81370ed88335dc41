"""The torch IterableDataset: DataLoader workers x DDP ranks, exactly once, resume, training."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from conftest import REPO, Daemon, sample_ids  # noqa: E402
from launches import EXAMPLES, FORKS_THEN_GRPC, FRAMEWORKS, GRPC, NO_GRPC, PYTHON, TORCHRUN_GROUP, Run  # noqa: E402
import larder.torch as larder_torch  # noqa: E402
from larder.torch import LarderIterableDataset  # noqa: E402


def ids_of(loader):
    """Sample ids in the order the loader yields them, read back from the pixel data."""
    out = []
    for images, labels in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (2, 4, 4)
        out += sample_ids(images, labels)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_and_ranks_cover_the_epoch_exactly_once(daemon, workers):
    seen = []
    for rank in range(2):
        ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=5, rank=rank, world_size=2)
        ds.set_epoch(3)
        seen += ids_of(DataLoader(ds, batch_size=None, num_workers=workers))
    assert sorted(seen) == list(range(300))


def test_resuming_mid_epoch_with_workers(daemon):
    ds = LarderIterableDataset("train", 7, address=daemon.unix, seed=1)
    full = ids_of(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(full) == list(range(300))
    # Stop after 21 batches, as a checkpoint would; resume from step 21 (worker 1's turn).
    ds.set_epoch(0)  # iterated again, it would serve the next epoch
    first = []
    for step, (images, labels) in enumerate(DataLoader(ds, batch_size=None, num_workers=2)):
        if step == 21:
            break
        first.append((images, labels))
    resumed = LarderIterableDataset("train", 7, address=daemon.unix, seed=1, start_step=21)
    rest = ids_of(DataLoader(resumed, batch_size=None, num_workers=2))
    together = ids_of(first) + rest
    assert sorted(together) == list(range(300)), "nothing lost, nothing twice"
    assert together == full, "and in the same order as the uninterrupted epoch"


def epochs_of(ds, loader, n):
    """The orders of n epochs, each checked to be every sample exactly once."""
    orders = []
    for _ in range(n):
        ids = ids_of(loader)
        assert sorted(ids) == list(range(300)), "every sample exactly once per epoch"
        orders.append(ids)
    return orders


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_iterating_again_is_the_next_epoch(daemon, workers, persistent):
    # Nobody calls set_epoch (as Lightning does not for an IterableDataset).
    ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent)
    orders = epochs_of(ds, loader, 3)
    assert orders[0] != orders[1] != orders[2] != orders[0], "a new order every epoch"
    # The same epochs, asked for explicitly, give the same orders: set_epoch wins.
    again = LarderIterableDataset("train", 8, address=daemon.unix, seed=4)
    again_loader = DataLoader(again, batch_size=None, num_workers=workers, persistent_workers=persistent)
    again.set_epoch(1)
    assert ids_of(again_loader) == orders[1]
    assert ids_of(again_loader) == orders[2], "and the next iteration goes on from it"
    again.set_epoch(0)
    assert ids_of(again_loader) == orders[0], "set_epoch reaches persistent workers too"


def test_even_batches_give_every_rank_the_same_steps(daemon):
    # 300 samples, batches of 7, 2 ranks: 21 full rounds of 14, then 6 left: 3 for each rank.
    counts, seen = [], []
    for rank in range(2):
        ds = LarderIterableDataset("train", 7, address=daemon.unix, seed=2, rank=rank, world_size=2)
        batches = list(DataLoader(ds, batch_size=None, num_workers=2))
        counts.append([len(b[1]) for b in batches])
        seen += ids_of(batches)
    assert counts[0] == counts[1] == [7] * 21 + [3], "the same number of batches on every rank"
    assert sorted(seen) == list(range(300))
    uneven = LarderIterableDataset("train", 7, address=daemon.unix, seed=2, rank=1, world_size=2,
                                   even_batches=False)
    assert [len(b[1]) for b in DataLoader(uneven, batch_size=None)] == [7] * 21, "the rest went to rank 0"


def test_state_dict_resumes_on_another_number_of_ranks(daemon):
    """Elastic: two ranks stop after 5 steps; three ranks go on with exactly the rest."""
    seen, states = [], []
    for rank in range(2):
        ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=9, rank=rank, world_size=2)
        ds.set_epoch(2)
        it = iter(DataLoader(ds, batch_size=None))
        seen += ids_of([next(it) for _ in range(5)])
        states.append(ds.state_dict())
        del it
    assert states[0] == states[1], "ranks in step agree on where the job stands"
    assert states[0]["epoch"] == 2 and states[0]["sample"] == 5 * 2 * 8
    for even in (False, True):
        rest = []
        for rank in range(3):
            ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=9, rank=rank, world_size=3,
                                       even_batches=even)
            ds.load_state_dict(states[0])
            rest += ids_of(DataLoader(ds, batch_size=None))
            assert ds.state_dict()["epoch"] == 3, "after the epoch, a checkpoint resumes the next one"
        assert set(seen) | set(rest) == set(range(300)), "nothing lost"
        # Even batches pad the last round with the first samples of the order (seen already).
        assert len(seen) + len(rest) - 300 == (2 if even else 0), "nothing twice but the padding"


@pytest.mark.parametrize("persistent", [False, True])
def test_stateful_dataloader_resumes_mid_epoch_with_workers(daemon, persistent):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        ds = LarderIterableDataset("train", 7, address=daemon.unix, seed=6)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)

    full = ids_of(loader())
    first, it = [], iter(l := loader())
    for _ in range(13):
        first.append(next(it))
    state = l.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    rest = ids_of(resumed)
    together = ids_of(first) + rest
    assert sorted(together) == list(range(300)), "nothing lost, nothing twice"
    assert together == full, "in the order of the uninterrupted epoch"
    assert ids_of(resumed) != full, "and the loader goes on to the next epoch"


def train_example(group, name, dataset, epochs):
    return group.add(name, EXAMPLES / "train.py", "--address", "{quad}", "--dataset", dataset, "--epochs", epochs,
                     "--batch-size", 32, "--workers", 2, "--classes", 4, grpc=FORKS_THEN_GRPC)


TRAIN_EXAMPLE = train_example(PYTHON, "train-example", "quad", 3)
# 513 samples on 2 ranks: 16 rounds of 64, then 1 left. Were the ranks given 257 and 256
# samples, the one with fewer batches would leave and the other hang or fail in its next
# gradient sync; even batches give each 257 (one sample repeated), and the loop needs no join.
TRAIN_EXAMPLE_UNEVEN = train_example(TORCHRUN_GROUP, "train-example-uneven", "quad-513", 2)


def test_example_training_script_learns(launched):
    out = launched(TRAIN_EXAMPLE)
    assert out.ok, out.failure()
    last = [l for l in out.stdout.splitlines() if l.startswith("epoch 2")]
    assert last, out.stdout
    accuracy = float(last[0].split("accuracy ")[1].split()[0])
    assert accuracy > 0.9, out.stdout
    assert "larderd memory hit rate" in out.stdout


def test_example_under_torchrun_with_uneven_ranks(launched):
    out = launched(TRAIN_EXAMPLE_UNEVEN)
    assert out.ok, out.failure()
    lines = re.findall(r"epoch (\d+): loss \S+ accuracy \S+ \((\d+) samples", out.stdout)
    for epoch in range(2):
        assert sorted(int(n) for e, n in lines if e == str(epoch)) == [257, 257], out.stdout


# Two ranks of torchrun's process group, each iterating an epoch with DataLoader workers forked,
# then spawned.
DDP_RANKS = TORCHRUN_GROUP.add("ddp-ranks", FRAMEWORKS / "ddp_ranks.py", "{train}", "{out}", call=True,
                               grpc=NO_GRPC)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_ddp_ranks_from_a_real_process_group(launched, context):
    out = launched(DDP_RANKS)
    assert out.ok, out.failure()
    records = [json.loads((DDP_RANKS.out / f"{context}-rank{r}.json").read_text()) for r in range(2)]
    assert all(r["len"] == 10 for r in records), "len() is this rank's batches"
    shards = [r["ids"] for r in records]
    assert all(len(s) == 150 for s in shards)
    assert sorted(shards[0] + shards[1]) == list(range(300)), "each sample on exactly one rank"


@pytest.mark.parametrize("even,drop_last", [(True, False), (False, False), (True, True)])
def test_len_is_the_batches_each_rank_gets(daemon, even, drop_last):
    for rank in range(3):
        ds = LarderIterableDataset("train", 7, address=daemon.unix, seed=2, rank=rank, world_size=3,
                                   even_batches=even, drop_last=drop_last)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        assert len(loader) == len(list(loader))


def _workers_script(address: str, workers: int) -> str:
    return (
        "import sys, warnings; warnings.simplefilter('default')\n"
        "from torch.utils.data import DataLoader\n"
        "from larder.torch import LarderIterableDataset\n"
        f"ds = LarderIterableDataset('train', 8, address={address!r})\n"
        "for epoch in range(2):\n"
        f"    n = sum(len(l) for _, l in DataLoader(ds, batch_size=None, num_workers={workers}, persistent_workers=False))\n"
        "    assert n == 300, n\n"
    )


NO_TORCHVISION = (
    "import sys; sys.modules['torchvision'] = None\n"
    "import larder.torch as lt\n"
    "from larder.torch import DataLoader, datasets\n"
    "import larder.torch.datasets\n"
    "assert next(iter(DataLoader([1, 2, 3], batch_size=2))).tolist() == [1, 2]\n"
    "try:\n"
    "    datasets.FakeData\n"
    "except AttributeError as e:\n"
    "    assert 'torchvision is not installed' in str(e), e\n"
    "else:\n"
    "    raise SystemExit('FakeData without torchvision')\n"
)


@pytest.fixture(scope="module")
def fresh_processes(services):
    """{name: (exit status, stderr)} of scripts that need a process of their own (what is said
    once per process; a process without torchvision), run side by side."""
    import os

    scripts = {f"workers-{w}": _workers_script(services["train"], w) for w in (0, 2)}
    scripts["no-torchvision"] = NO_TORCHVISION
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True, env=env) for name, code in scripts.items()}
    out = {}
    for name, p in procs.items():
        _, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stderr)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_workers_are_said_once_to_cost_a_copy(fresh_processes, workers):
    """A port that keeps its script's num_workers is told once what to change; the
    recommended setup hears nothing."""
    returncode, stderr = fresh_processes[f"workers-{workers}"]
    assert returncode == 0, stderr
    said = stderr.count("is iterated in DataLoader workers")
    assert said == (1 if workers else 0), stderr
    if workers:
        assert "num_workers=0" in stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_evaluation_under_ranks_counts_every_sample_exactly_once(daemon, workers):
    """300 samples on 7 ranks in batches of 8: even_batches pads the last round (the ranks get
    the same number of batches); the validity mask leaves the padding out, so correct/total over
    the ranks is over exactly the 300 samples."""
    from larder.torch import exact_counts

    per_rank, valid_ids, correct, total = [], [], 0, 0
    for rank in range(7):
        ds = LarderIterableDataset("train", 8, address=daemon.unix, shuffle=False, rank=rank,
                                   world_size=7, valid=True)
        batches = 0
        for images, labels, valid in DataLoader(ds, batch_size=None, num_workers=workers):
            assert valid.dtype == torch.bool and valid.shape == labels.shape
            ids = sample_ids(images, labels)
            valid_ids += [i for i, v in zip(ids, valid.tolist()) if v]
            # A "model" right on even ids.
            right = torch.tensor([i % 2 == 0 for i in ids])
            c, t = exact_counts(right, valid)
            correct, total = correct + c, total + t
            batches += 1
        per_rank.append(batches)
    assert len(set(per_rank)) == 1, per_rank
    assert sorted(valid_ids) == list(range(300))
    assert (correct, total) == (150, 300)


def test_loader_takes_a_scripts_dataloader_arguments_and_answers_like_a_sampler(daemon, caplog):
    """`larder.torch.loader` in place of `DataLoader(..., shuffle=True, num_workers=4,
    sampler=DistributedSampler(...), pin_memory=True, persistent_workers=True)`: no worker
    process, one log line of what it left aside, and the sampler/dataset answers scripts read."""
    import logging

    import larder.torch as lt

    ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=3, rank=1, world_size=2)
    with caplog.at_level(logging.INFO, logger="larder"):
        loader = lt.loader(ds, batch_size=8, shuffle=True, sampler=object(), num_workers=4,
                           persistent_workers=True, prefetch_factor=4)
    said = [r.getMessage() for r in caplog.records if r.name == "larder"]
    assert len(said) == 1 and "num_workers=4" in said[0] and "sampler=object" in said[0], said
    assert loader.num_workers == 0
    assert len(loader.dataset) == 300, "the dataset's samples"
    assert len(loader.sampler) == 150, "this rank's samples"
    assert len(loader) == len(ds) == 19, "this rank's batches (150 in 8s, padded)"
    loader.sampler.set_epoch(4)
    seen = ids_of(loader)
    same = LarderIterableDataset("train", 8, address=daemon.unix, seed=3, rank=1, world_size=2)
    same.set_epoch(4)
    assert seen == ids_of(DataLoader(same, batch_size=None)), "set_epoch picked epoch 4"
    other = LarderIterableDataset("train", 8, address=daemon.unix, seed=3, rank=0, world_size=2)
    other.set_epoch(4)
    # Both ranks: every sample exactly once (300 split evenly: no padding; each rank's last
    # batch holds 6), counted, not only as a set.
    both = seen + ids_of(lt.loader(other))
    assert sorted(both) == list(range(300)), len(both)
    with pytest.raises(TypeError, match="LarderIterableDataset"):
        lt.loader([1, 2, 3])

    # The script's own sampler's set_epoch (what pytorch/examples calls) moves the dataset too.
    class Sampler:
        def set_epoch(self, epoch):
            self.epoch = epoch

    own, followed = Sampler(), LarderIterableDataset("train", 8, address=daemon.unix, seed=3)
    lt.loader(followed, sampler=own)
    own.set_epoch(5)
    assert own.epoch == 5 and followed.epoch == 5

    # A DistributedSampler built over a larder dataset says what to do, once; the loader takes
    # it, and a plain DataLoader still refuses it (PyTorch's own check).
    from torch.utils.data.distributed import DistributedSampler

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="larder"):
        dist_sampler = DistributedSampler(ds, num_replicas=2, rank=1)
        DistributedSampler(ds, num_replicas=2, rank=0)
    said = [r.getMessage() for r in caplog.records if "DistributedSampler" in r.getMessage()]
    assert len(said) == 1 and "larder.torch.loader" in said[0], said
    lt.loader(ds, sampler=dist_sampler)
    dist_sampler.set_epoch(6)
    assert ds.epoch == 6
    with pytest.raises(ValueError, match="sampler"):
        DataLoader(ds, sampler=dist_sampler)


def test_batches_come_normalized_in_the_dtype_and_layout_asked(daemon):
    mean, std = (0.5, 0.25), (0.5, 0.125)
    plain = LarderIterableDataset("train", 10, address=daemon.unix, seed=2)
    ready = LarderIterableDataset("train", 10, address=daemon.unix, seed=2, normalize=(mean, std),
                                  device="cpu", dtype=torch.float64, channels_last=True)
    for (raw, labels), (x, y) in zip(DataLoader(plain, batch_size=None), DataLoader(ready, batch_size=None)):
        assert x.dtype == torch.float64 and x.is_contiguous(memory_format=torch.channels_last)
        expect = (raw.double() / 255 - torch.tensor(mean, dtype=torch.float64).view(1, 2, 1, 1)) \
            / torch.tensor(std, dtype=torch.float64).view(1, 2, 1, 1)
        assert torch.allclose(x, expect, atol=1e-5)
        assert torch.equal(labels, y)


def _quadrant_folders(root, counts, size=40):
    """Image folders of 4 classes (a bright quadrant each) as PNGs: root/<split>/c<k>/<i>.png."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    for split, n in counts.items():
        for i in range(n):
            c = i % 4
            y, x = divmod(c, 2)
            h = size // 2
            a = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            a[y * h:y * h + h, x * h:x * h + h] += 150
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(a).save(root / split / f"c{c}" / f"{i}.png")


def example(ranks: int, name: str, script: str, *args, setup) -> Run:
    """python/examples/`script` with `args`, in one process or under torchrun with `ranks` ranks,
    on the datasets of its own that it adds by path (the session's "folders" daemon, on
    $LARDER_ADDR too), made by `setup(out)` in its own folder."""
    group = PYTHON if ranks == 1 else TORCHRUN_GROUP
    return group.add(f"{name}-{ranks}", EXAMPLES / script, *args, env={"LARDER_ADDR": "{folders}"}, setup=setup)


def succeeded(launched, run):
    """The run's outcome, which must have succeeded (the failure shows the first error: a rank
    that failed, which the launcher's own report follows, and the end)."""
    out = launched(run)
    assert out.ok, out.failure()
    return out


IMAGENET = {ranks: example(ranks, "imagenet", "imagenet_train.py", "{out}/data", "--epochs", 3, "-b", 16,
                           "--classes", 4, "--lr", 0.05, "--crop", 32, "--resize", 36,
                           setup=lambda out: _quadrant_folders(out / "data", {"train": 101, "val": 101}))
            for ranks in (1, 2)}


@pytest.mark.parametrize("ranks", [1, 2])
def test_imagenet_shaped_example_trains_and_validates_every_image_once(launched, ranks):
    """The example in the shape of pytorch/examples' ImageNet script, ported in three lines
    (the import of `datasets`, and `DataLoader` for both loaders): its torchvision transforms,
    DistributedSamplers and DataLoader arguments (4 workers) as the script has them. On 101 val
    images and 2 ranks, validation counts exactly the 101 (not 102 with the padding that evens
    the ranks)."""
    out = succeeded(launched, IMAGENET[ranks])
    vals = re.findall(r"epoch (\d+): val Acc@1 (\S+) Acc@5 (\S+) over (\d+) images \(the dataset has (\d+)\)",
                      out.stdout)
    assert [v[0] for v in vals] == ["0", "1", "2"], out.stdout
    assert all(v[3] == v[4] == "101" for v in vals), out.stdout
    assert float(vals[-1][2]) == 100.0, "top-5 of 4 classes"
    trained = re.findall(r"rank (\d+) epoch 0: train .*? \((\d+) samples", out.stdout)
    assert sorted(int(n) for _, n in trained) == ([101] if ranks == 1 else [51, 51]), out.stdout
    # Each rank's own view of its input each epoch (a small model on a few images: any verdict).
    stats = re.findall(r"rank (\d+) epoch (\d+): InputStats\((\S+) on (\S+): (\S+), waited", out.stdout)
    assert len(stats) == 3 * ranks and all(v in ("input-bound", "balanced", "compute-bound", "starting")
                                           for *_, v in stats), out.stdout


HAS_TIMM = importlib.util.find_spec("timm") is not None
TIMM_RECIPE = {ranks: example(ranks, "timm-recipe", "timm_train.py", "--folder", "--train", "{out}/train",
                              "--val", "{out}/val", "--model", "test_resnet", "--img-size", 32, "--classes", 4,
                              "-b", 8, "--epochs", 2,
                              setup=lambda out: _quadrant_folders(out, {"train": 100, "val": 41}))
               for ranks in (1, 2) if HAS_TIMM}


@pytest.mark.parametrize("ranks", [1, 2])
def test_timm_recipe_trains_through_timms_prefetcher_with_mixup_and_validates_exactly(launched, ranks):
    """The timm recipe on image folders named by path: a timm model and optimizer, batches through
    timm's PrefetchLoader and Mixup, the last partial batch dropped as timm does; validation over
    exactly the val images on 1 and 2 ranks."""
    if not HAS_TIMM:
        pytest.skip("timm is not installed here")
    out = succeeded(launched, TIMM_RECIPE[ranks])
    vals = re.findall(r"epoch (\d+): val top-1 (\S+) over (\d+) images \(the dataset has (\d+)\)", out.stdout)
    assert [v[0] for v in vals] == ["0", "1"] and all(v[2] == v[3] == "41" for v in vals), out.stdout
    trained = re.findall(r"rank (\d+) epoch (\d+): train loss (\S+) \((\d+) samples\)", out.stdout)
    # Whole rounds of 8 per rank; the short last one dropped.
    assert sorted(int(n) for *_, n in trained) == [100 // (8 * ranks) * 8] * (2 * ranks), out.stdout
    assert all(float(loss) == float(loss) for _, _, loss, _ in trained), "no NaN loss"


def test_ranks_naming_one_folder_at_once_all_get_it(tmp_path):
    """Under torchrun every rank calls `ImageFolder(path)` at once: one adds the folder, the
    others get ALREADY_EXISTS while the daemon is still walking it, and wait until it is served
    (rather than raise "added but is not served"). Three callers at once, each with its own
    connection, as three ranks."""
    import io
    import threading

    import numpy as np
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(png, "PNG")
    for i in range(3000):  # enough that walking the folder takes the other callers' whole calls
        c = i % 4
        (tmp_path / "f" / f"c{c}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "f" / f"c{c}" / f"{i}.png").write_bytes(png.getvalue())
    d = Daemon(tmp_path, "")
    names, errors, start = [], [], threading.Barrier(3)

    def rank():
        try:
            start.wait()
            names.append(larder_torch.ImageFolder(str(tmp_path / "f"), 8, address=d.unix).dataset)
        except Exception as e:  # handed to the test
            errors.append(e)

    try:
        ranks = [threading.Thread(target=rank) for _ in range(3)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(180)
    finally:
        d.stop()
    assert not errors, errors
    assert len(names) == 3 and len(set(names)) == 1, names


def test_image_folder_by_path_is_added_once_and_streams_both_recipes(tmp_path):
    """`larder.torch.ImageFolder(path, ...)` as a script's `datasets.ImageFolder(path, ...)`:
    the first call adds the folder as the caller's dataset, the second (same sizes) finds it."""
    from PIL import Image

    import larder
    from larder.torch import ImageFolder

    root = tmp_path / "train"
    for i in range(10):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (120 + i, 90), (20 * i, 100, 50)).save(root / f"c{i % 2}" / f"{i}.jpg")
    d = Daemon(tmp_path, "")
    try:
        train = ImageFolder(root, 4, resize=64, crop=48, address=d.unix, seed=1)
        val = ImageFolder(root, 4, train=False, resize=64, crop=48, address=d.unix, valid=True)
        assert train.dataset == val.dataset and "/" in train.dataset
        with larder.Client(d.unix) as c:
            assert [x.name for x in c.datasets()].count(train.dataset) == 1
        n = 0
        for images, labels in DataLoader(train, batch_size=None):
            assert images.shape[1:] == (3, 48, 48) and images.dtype == torch.uint8
            n += len(labels)
        assert n == 10
        total = sum(int(v.sum()) for _, _, v in DataLoader(val, batch_size=None))
        assert total == 10
        # timm's --scale/--ratio/--hflip: a train recipe of its own, its own dataset.
        tuned = ImageFolder(root, 4, resize=64, crop=48, address=d.unix, scale=(0.5, 1.0), ratio=(0.9, 1.1),
                            hflip=False)
        assert tuned.dataset != train.dataset
        assert sum(len(labels) for _, labels in DataLoader(tuned, batch_size=None)) == 10
    finally:
        d.stop()


# A Lightning fit of 2 epochs with larder.lightning.InputStats() (the loader starts no workers).
LIGHTNING_CALLBACK = PYTHON.add("lightning-callback", FRAMEWORKS / "lightning_callback.py", "{train}", "{out}",
                                call=True, grpc=GRPC)


def test_lightning_callback_logs_each_epochs_input_stats(launched):
    """`larder.lightning.InputStats()`: at each training epoch's end, the larder dataset under
    the trainer's loader is found, its InputStats logged as one line and as metrics."""
    out = launched(LIGHTNING_CALLBACK)
    assert out.ok, out.failure()
    found = json.loads((LIGHTNING_CALLBACK.out / "found.json").read_text())
    last = found["last"]
    assert len(last) == 1 and last[0]["dataset"] == "train"
    assert last[0]["batches"] == 2 * 19, "both epochs' batches, one meter"
    assert last[0]["verdict"] in ("input-bound", "balanced", "compute-bound", "starting")
    lines = [line for line in found["lines"] if "InputStats(" in line]
    assert [line.split(",")[0] for line in lines] == ["larder: epoch 0", "larder: epoch 1"], lines
    assert "larder/wait_ratio" in found["metrics"] and "larder/input_bound" in found["metrics"]


def test_torchvision_transforms_are_read_as_larders_pipelines():
    """The transforms of pytorch/examples' script (v1) and of a v2 script, read as the daemon's
    pipelines; what the daemon does not do is refused with where it goes instead."""
    T = pytest.importorskip("torchvision.transforms")
    from larder.datasets import recipe

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = recipe(T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    assert train.folder_kwargs() == {
        "train": True, "crop": 224, "scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3), "hflip": True,
        "interpolation": "bilinear", "dtype": torch.float32, "device": "auto",
        "normalize": ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])}
    val = recipe(T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    assert val.folder_kwargs() == {
        "train": False, "crop": 224, "resize": 256, "interpolation": "bilinear", "dtype": torch.float32,
        "device": "auto", "normalize": ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])}
    # timm's eval recipe (bicubic, crop_pct 0.95 -> Resize(235)), uint8 kept as it comes.
    timm_val = recipe(T.Compose([T.Resize(235, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224),
                                 T.PILToTensor()]))
    assert timm_val.folder_kwargs() == {"train": False, "crop": 224, "resize": 235, "interpolation": "bicubic"}
    v2 = pytest.importorskip("torchvision.transforms.v2")
    train2 = recipe(v2.Compose([v2.RandomResizedCrop(176, scale=(0.25, 1)), v2.RandomHorizontalFlip(),
                                v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]))
    assert train2.folder_kwargs()["crop"] == 176 and train2.folder_kwargs()["scale"] == (0.25, 1.0)
    assert train2.folder_kwargs()["dtype"] == torch.float32 and "normalize" not in train2.folder_kwargs()
    # No RandomHorizontalFlip: no flips (the daemon's train pipeline flips by default).
    assert recipe(T.Compose([T.RandomResizedCrop(224), T.ToTensor()])).folder_kwargs()["hflip"] is False
    from torchvision import tv_tensors

    per_type = recipe(v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.ToImage(),
                                  v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True)]))
    assert per_type.folder_kwargs()["dtype"] == torch.float32

    for bad, said in [
        (T.Compose([T.RandomResizedCrop(224), T.ColorJitter(0.4), T.ToTensor()]), "ColorJitter.*on the GPU"),
        (T.Compose([T.Resize(256), T.CenterCrop(224)]), "PIL images"),
        (None, "PIL images"),
        (T.Compose([T.CenterCrop(224), T.ToTensor()]), "Resize"),
        (T.Compose([T.Resize((256, 320)), T.CenterCrop(224), T.ToTensor()]), "square|aspect"),
        (T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(p=0.3), T.ToTensor()]), "p=0.5"),
        (T.Compose([T.ToTensor(), T.RandomResizedCrop(224)]), "after ToTensor"),
    ]:
        with pytest.raises(ValueError, match=said):
            recipe(bad)


def test_ported_datasets_and_dataloader_serve_the_script_its_own_recipe(tmp_path, caplog):
    """`from larder.torch import datasets, DataLoader`: ImageFolder with the script's eval
    transforms and DataLoader with the script's arguments (4 workers, shuffle=False) give float
    batches normalized as torchvision's Normalize would the daemon's eval crop, every image
    once; len() is images and classes are the folder's; other datasets are torchvision's and
    load through torch's own DataLoader; torch's DataLoader over a larder folder says what to do."""
    import logging

    T = pytest.importorskip("torchvision.transforms")
    from larder.torch import DataLoader as LarderLoader, datasets

    _quadrant_folders(tmp_path / "data", {"val": 37})
    d = Daemon(tmp_path, "")
    try:
        import os

        os.environ["LARDER_ADDR"] = d.unix
        mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
        val = datasets.ImageFolder(str(tmp_path / "data" / "val"), T.Compose(
            [T.Resize(36), T.CenterCrop(32), T.ToTensor(), T.Normalize(mean=mean, std=std)]))
        assert len(val) == 37 and val.classes == ["c0", "c1", "c2", "c3"] and val.class_to_idx["c3"] == 3
        with caplog.at_level(logging.INFO, logger="larder"):
            loader = LarderLoader(val, batch_size=8, shuffle=False, num_workers=4, pin_memory=False)
        assert any("num_workers=4" in r.getMessage() for r in caplog.records)
        assert len(loader.dataset) == 37 and len(loader) == 5
        plain = larder_torch.ImageFolder(str(tmp_path / "data" / "val"), 8, train=False, resize=36, crop=32)
        seen = 0
        for (x, y), (raw, labels) in zip(loader, DataLoader(plain, batch_size=None)):
            assert x.dtype == torch.float32 and x.shape[1:] == (3, 32, 32)
            expect = (raw.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
            assert torch.allclose(x, expect, atol=1e-5) and torch.equal(y, labels)
            seen += len(y)
        assert seen == 37
        with pytest.raises(TypeError, match="larder.torch.DataLoader"):
            next(iter(DataLoader(val, batch_size=8)))
        # The script's names for its loader's dataset, as torchvision's ImageFolder has them.
        assert loader.dataset.classes == val.classes and loader.dataset.root == val.root
        # The loader decides the order: an eval transform under shuffle=True (a linear probe's
        # training set) is shuffled, with even batch counts for DDP; a sampler's shuffle counts.
        shuffled = LarderLoader(val, batch_size=8, shuffle=True)
        assert shuffled.dataset.ds.shuffle and shuffled.dataset.ds.even_batches
        from torch.utils.data.distributed import DistributedSampler

        by_sampler = LarderLoader(val, batch_size=8, sampler=DistributedSampler(val, num_replicas=2, rank=0))
        assert by_sampler.dataset.ds.shuffle
        assert not loader.dataset.ds.shuffle and not loader.dataset.ds.even_batches
        with pytest.raises(FileNotFoundError):
            datasets.ImageFolder(str(tmp_path / "nowhere"), T.Compose([T.Resize(36), T.CenterCrop(32), T.ToTensor()]))
        fake = datasets.FakeData(10, (3, 8, 8), 2, T.ToTensor())
        other = LarderLoader(fake, batch_size=5)
        assert type(other) is DataLoader and next(iter(other))[0].shape == (5, 3, 8, 8)
    finally:
        os.environ.pop("LARDER_ADDR", None)
        d.stop()


def test_larder_torch_needs_no_torchvision(fresh_processes):
    """Without torchvision, larder.torch and its DataLoader still work for other datasets;
    torchvision's names say what is missing."""
    returncode, stderr = fresh_processes["no-torchvision"]
    assert returncode == 0, stderr[-2000:]


TIMM_PORT = {ranks: example(ranks, "timm-port", "timm_port.py", "--data-dir", "{out}", "--model", "test_resnet",
                            "--img-size", 32, "--num-classes", 4, "-b", 8, "--epochs", 2, "--mixup", 0.8,
                            "--cutmix", 1.0, "--reprob", 0.25,
                            setup=lambda out: _quadrant_folders(out, {"train": 100, "val": 41}))
             for ranks in (1, 2) if HAS_TIMM}


@pytest.mark.parametrize("ranks", [1, 2])
def test_timm_train_py_shaped_script_ported_in_one_line(launched, ranks):
    """A script in the shape of timm's train.py (create_dataset / create_loader with its own
    arguments and defaults: colour jitter 0.4, random interpolation; mixup as FastCollateMixup
    under the prefetcher; random erasing), ported by one added import: whole train batches of
    float images on the device with soft targets, every rank as many val batches (timm's
    per-batch all-reduce), the val images padded to equal shares as timm's own sampler does."""
    if not HAS_TIMM:
        pytest.skip("timm is not installed here")
    out = succeeded(launched, TIMM_PORT[ranks])
    assert "served bilinear" in out.stderr  # timm's 'random' interpolation, said
    # (torchrun interleaves the ranks' lines: every pattern stops at its own end)
    trained = re.findall(r"rank (\d+) epoch (\d+): train loss (\S+) \((\d+) samples, (\d+) batches of (\d+); "
                         r"(\[.*?\])\)", out.stdout)
    assert len(trained) == 2 * ranks, out.stdout
    per_rank = 100 // (8 * ranks) * 8
    for _, _, loss, samples, batches, planned, shapes in trained:
        assert int(samples) == per_rank and int(batches) == int(planned) == per_rank // 8, out.stdout
        assert shapes == "[((3, 32, 32), 'torch.float32', (4,))]", shapes  # soft targets: mixed
        assert float(loss) == float(loss)
    vals = re.findall(r"rank (\d+) epoch (\d+): val top-1 (\S+) over (\d+) samples in (\d+) batches", out.stdout)
    assert len(vals) == 2 * ranks, out.stdout
    share = -(-41 // ranks)
    assert all(int(n) == share and int(b) == -(-share // 8) for *_, n, b in vals), out.stdout


def test_colour_jitter_on_the_device_is_torchvisions_per_sample():
    """larder.timm.color_jitter with given factors and order equals torchvision's
    adjust_brightness / adjust_contrast / adjust_saturation applied per sample in that order;
    drawn, each factor lies in [1 - s, 1 + s]."""
    F = pytest.importorskip("torchvision.transforms.functional")
    from larder.timm import color_jitter

    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 9, 7, generator=g)
    factors = torch.tensor([[0.7, 1.3, 0.9], [1.2, 0.6, 1.4], [1.0, 1.0, 0.0], [1.4, 1.4, 1.4]])
    order = torch.tensor([[0, 1, 2], [2, 1, 0], [1, 2, 0], [2, 0, 1]])
    got = color_jitter(x.clone(), (0.4, 0.4, 0.4), factors=factors, order=order)
    ops = [F.adjust_brightness, F.adjust_contrast, F.adjust_saturation]
    for i in range(4):
        want = x[i]
        for k in order[i].tolist():
            want = ops[k](want, float(factors[i, k]))
        assert torch.allclose(got[i], want, atol=1e-5), i
    # Drawn: brightness alone moves a mid-grey image by at most 40%, and not all alike.
    drawn = color_jitter(torch.full((64, 3, 2, 2), 128.0), (0.4, 0.0, 0.0), scale=255.0)
    assert drawn.min() >= 128 * 0.6 - 1e-3 and drawn.max() <= 128 * 1.4 + 1e-3 and drawn.std() > 5
