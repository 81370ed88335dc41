"""Under the training frameworks, run for real (CPU, 2 processes where distributed): every
epoch covers every sample exactly once (up to DDP padding), each epoch in a new order, and a
resumed job goes on with exactly the samples not yet seen. The scripts are in frameworks/; the
runs are launched together, one group per launcher (launches.py), and each test reads its own."""

import json
import pathlib
import re

import pytest

from conftest import REPO
from launches import EXAMPLES, FRAMEWORKS, GRPC, LIGHTNING_DDP, NO_GRPC, PYTHON, TORCHRUN_GROUP

pytest.importorskip("torch")
N = 300
LIGHTNING = FRAMEWORKS / "lightning_fit.py"
TORCHRUN_FIT = FRAMEWORKS / "torchrun_fit.py"
ACCELERATE_FIT = FRAMEWORKS / "accelerate_fit.py"


def ran(launched, run):
    """The run's outcome, which must have ended without error."""
    out = launched(run)
    assert out.ok, out.failure()
    return out


def recorded(*dirs):
    """{epoch: {rank: ids in the order trained on}} from the runs' records, in order."""
    epochs = {}
    for d in dirs:
        for path in sorted(pathlib.Path(d).glob("ids-*.jsonl")):
            rank = int(path.stem.split("-")[1])
            for line in path.read_text().splitlines():
                r = json.loads(line)
                epochs.setdefault(r["epoch"], {}).setdefault(rank, []).extend(r["ids"])
    return epochs


def check(epochs, n_epochs, world=1):
    """Every epoch every sample exactly once (DDP padding repeats fewer than `world`), ranks
    the same number of samples, and each epoch in a new order. Returns the orders."""
    assert sorted(epochs) == list(range(n_epochs))
    orders = []
    for e in range(n_epochs):
        per_rank = epochs[e]
        assert sorted(per_rank) == list(range(world)), f"epoch {e}: ranks {sorted(per_rank)}"
        ids = [i for r in range(world) for i in per_rank[r]]
        assert set(ids) == set(range(N)), f"epoch {e}: {N - len(set(ids))} samples missing"
        assert len(ids) - N < world, f"epoch {e}: {len(ids) - N} samples twice"
        assert len({len(v) for v in per_rank.values()}) == 1, "every rank as many samples"
        orders.append(ids)
    for e in range(1, n_epochs):
        assert orders[e] != orders[e - 1], f"epoch {e} repeats epoch {e - 1}'s order"
    return orders


# Lightning in one process: DataLoader workers, 3 epochs.
LIGHTNING_SINGLE = PYTHON.add("lightning-single", LIGHTNING, "{train}", "{out}", "--workers", 2, "--epochs", 3,
                              call=True, grpc=NO_GRPC)
# Lightning's own DDP: 2 processes it starts, each with workers.
LIGHTNING_TWO = LIGHTNING_DDP.add("lightning-ddp", LIGHTNING, "{train}", "{out}", "--devices", 2, "--workers", 2,
                                  "--epochs", 2, call=True, grpc=NO_GRPC)


def test_lightning_single_process_with_workers(launched):
    ran(launched, LIGHTNING_SINGLE)
    check(recorded(LIGHTNING_SINGLE.out), 3)


def test_lightning_ddp_two_processes(launched):
    ran(launched, LIGHTNING_TWO)
    check(recorded(LIGHTNING_TWO.out), 2, world=2)


def lightning_resume(devices):
    """(whole, first, second): a whole job; one that checkpoints every 4 steps and dies after
    9, so the last checkpoint is at step 8 and the 9th step's batch is lost work, trained on
    again after the resume; and that job resumed from its step 8."""
    group = PYTHON if devices == 1 else LIGHTNING_DDP
    name = f"lightning-resume-{devices}"
    common = ["--devices", devices, "--workers", 2, "--epochs", 2, "--stateful"]
    whole = group.add(f"{name}-whole", LIGHTNING, "{train}", "{out}", *common, call=True, grpc=NO_GRPC)
    first = group.add(f"{name}-first", LIGHTNING, "{train}", "{out}", *common, "--ckpt-every", 4,
                      "--stop-after", 9, call=True, grpc=NO_GRPC)
    second = group.add(f"{name}-second", LIGHTNING, "{train}", "{out}", *common,
                       "--resume", f"{{runs[{name}-first]}}/step=8.ckpt", call=True, grpc=NO_GRPC)
    return whole, first, second


LIGHTNING_RESUME = {devices: lightning_resume(devices) for devices in (1, 2)}


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_resumes_from_a_mid_epoch_checkpoint(launched, devices):
    for run in LIGHTNING_RESUME[devices]:
        ran(launched, run)
    whole, first, second = (run.out for run in LIGHTNING_RESUME[devices])
    for path in first.glob("ids-*.jsonl"):
        lines = path.read_text().splitlines()
        assert len(lines) == 9
        path.write_text("\n".join(lines[:8]) + "\n")  # the lost step's batch is trained on again
    resumed = check(recorded(first, second), 2, world=devices)
    assert resumed == check(recorded(whole), 2, world=devices), "as if never interrupted"


ACCELERATE_PREPARED = {
    workers: TORCHRUN_GROUP.add(f"accelerate-prepared-{workers}", ACCELERATE_FIT, "{train}", "{out}",
                                "--workers", workers, "--epochs", 2, call=True, grpc=GRPC if workers == 0 else NO_GRPC)
    for workers in (0, 2)
}
ACCELERATE_UNPREPARED = TORCHRUN_GROUP.add("accelerate-unprepared", ACCELERATE_FIT, "{train}", "{out}",
                                           "--workers", 2, "--epochs", 2, "--no-prepare", call=True, grpc=NO_GRPC)
ACCELERATE_UNDISPATCHED = TORCHRUN_GROUP.add("accelerate-undispatched", ACCELERATE_FIT, "{train}", "{out}",
                                             "--dispatch-batches", "false", call=True, grpc=GRPC, may_fail=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_prepare_with_its_defaults(launched, workers):
    ran(launched, ACCELERATE_PREPARED[workers])
    check(recorded(ACCELERATE_PREPARED[workers].out), 2, world=2)


def test_accelerate_with_the_loader_left_out_of_prepare(launched):
    ran(launched, ACCELERATE_UNPREPARED)
    check(recorded(ACCELERATE_UNPREPARED.out), 2, world=2)


def test_accelerate_without_dispatch_fails_naming_the_setting(launched):
    out = launched(ACCELERATE_UNDISPATCHED)
    assert not out.ok, "the job failed"
    assert "dispatch_batches=False" in out.stderr and "DataLoaderConfiguration" in out.stderr, out.failure()
    assert not list(ACCELERATE_UNDISPATCHED.out.glob("ids-*.jsonl")), "failed before training on any batch"


TORCHRUN_PERSISTENT = {
    set_epoch: TORCHRUN_GROUP.add(f"torchrun-persistent-{set_epoch}", TORCHRUN_FIT, "{train}", "{out}",
                                  "--epochs", 3, "--persistent", *(["--set-epoch"] if set_epoch else []),
                                  call=True, grpc=NO_GRPC)
    for set_epoch in (True, False)
}


@pytest.mark.parametrize("set_epoch", [True, False])
def test_torchrun_with_persistent_workers(launched, set_epoch):
    ran(launched, TORCHRUN_PERSISTENT[set_epoch])
    check(recorded(TORCHRUN_PERSISTENT[set_epoch].out), 3, world=2)


def torchrun_resume(persistent):
    """(whole, first, second): a whole job, one that stops after 9 steps saving each rank's
    loader state, and that job resumed from it."""
    name = f"torchrun-stateful-{persistent}"
    flags = ["--epochs", 2, "--stateful"] + (["--persistent"] if persistent else [])
    whole = TORCHRUN_GROUP.add(f"{name}-whole", TORCHRUN_FIT, "{train}", "{out}", *flags, call=True, grpc=NO_GRPC)
    first = TORCHRUN_GROUP.add(f"{name}-first", TORCHRUN_FIT, "{train}", "{out}", *flags, "--stop-after", 9,
                               call=True, grpc=NO_GRPC)
    second = TORCHRUN_GROUP.add(f"{name}-second", TORCHRUN_FIT, "{train}", "{out}", *flags,
                                "--resume", f"{{runs[{name}-first]}}", call=True, grpc=NO_GRPC)
    return whole, first, second


TORCHRUN_RESUME = {persistent: torchrun_resume(persistent) for persistent in (True, False)}


@pytest.mark.parametrize("persistent", [True, False])
def test_torchrun_stateful_dataloader_resumes_mid_epoch(launched, persistent):
    for run in TORCHRUN_RESUME[persistent]:
        ran(launched, run)
    whole, first, second = (run.out for run in TORCHRUN_RESUME[persistent])
    assert check(recorded(first, second), 2, world=2) == check(recorded(whole), 2, world=2)


def readme_example(group, name, script, *args, env=None):
    """examples/SCRIPT (as the README shows it) on "quad", a learnable 512-sample set."""
    return group.add(name, EXAMPLES / script, "--address", "{quad}", "--dataset", "quad", "--classes", 4,
                     "--batch-size", 32, "--epochs", 3, *args, env=env, grpc=GRPC)


def accuracies(out):
    """{(epoch, rank): (accuracy, samples)} from an example's lines."""
    lines = re.findall(r"epoch (\d+) rank (\d+): accuracy (\S+) \((\d+) samples", out.stdout)
    return {(int(e), int(r)): (float(a), int(n)) for e, r, a, n in lines}


LIGHTNING_EXAMPLE = {devices: readme_example(PYTHON if devices == 1 else LIGHTNING_DDP,
                                             f"lightning-example-{devices}", "lightning_train.py",
                                             "--devices", devices)
                     for devices in (1, 2)}
# torchrun starts the processes (as `accelerate launch` does); Accelerate runs several processes
# on CPUs only when told to.
ACCELERATE_EXAMPLE = readme_example(TORCHRUN_GROUP, "accelerate-example", "accelerate_train.py",
                                    env={"ACCELERATE_USE_CPU": "true"})


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_example_learns(launched, devices):
    epochs = accuracies(ran(launched, LIGHTNING_EXAMPLE[devices]))
    assert sorted(epochs) == [(e, r) for e in range(3) for r in range(devices)]
    for r in range(devices):
        assert epochs[(2, r)][0] > 0.9, epochs
        assert epochs[(2, r)][1] == 512 // devices


def test_accelerate_example_learns(launched):
    epochs = accuracies(ran(launched, ACCELERATE_EXAMPLE))
    assert sorted(epochs) == [(e, r) for e in range(3) for r in range(2)]
    assert all(epochs[(2, r)][0] > 0.9 and epochs[(2, r)][1] == 256 for r in range(2)), epochs


def test_docs_excerpts_are_the_examples_the_tests_run():
    readme = "\n".join((REPO / p).read_text() for p in ("README.md", "docs/users.md") if (REPO / p).exists())
    blocks = re.findall(r"```python\n# (python/examples/\S+\.py)\n(.*?)```", readme, re.S)
    assert {path for path, _ in blocks} >= {"python/examples/train.py", "python/examples/lightning_train.py",
                                            "python/examples/accelerate_train.py"}
    for path, code in blocks:
        assert code in (REPO / path).read_text(), f"README's excerpt of {path} is not in it"
