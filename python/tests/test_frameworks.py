"""Under the training frameworks, run for real (CPU, 2 processes where distributed): every
epoch covers every sample exactly once (up to DDP padding), each epoch in a new order, and a
resumed job goes on with exactly the samples not yet seen. The scripts are in frameworks/."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import REPO, quadrant_daemon

pytest.importorskip("torch")
FRAMEWORKS = pathlib.Path(__file__).parent / "frameworks"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
N = 300


def stacks(session: int) -> str:
    """Python stacks of every process in session `session` (py-spy, where installed)."""
    spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    pids = subprocess.run(["ps", "-o", "pid=", "-s", str(session)], capture_output=True, text=True).stdout
    out = []
    for pid in pids.split():
        dump = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60)
        out.append(f"--- process {pid}\n{dump.stdout}{dump.stderr}")
    return "\n".join(out)


def run(launcher, script, address, out_dir, *args, fail=False, timeout=240):
    """Runs frameworks/SCRIPT ADDRESS OUT_DIR ARGS... in OUT_DIR (what it writes stays there).
    A run that hangs fails the test, with every process's Python stack (no second try: a hang
    is a bug, in the script, the client or the daemon)."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    cmd = launcher + [str(FRAMEWORKS / script), address, str(out_dir)] + [str(a) for a in args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=out_dir, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            where = stacks(proc.pid)
        except (OSError, subprocess.SubprocessError) as e:
            where = f"(no stacks: {e})"
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{script} {' '.join(map(str, args))} hung for {timeout} s\n{stderr[-4000:]}\n"
                    f"stacks:\n{where}")
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if not fail:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
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


def test_lightning_single_process_with_workers(daemon, tmp_path):
    run([sys.executable], "lightning_fit.py", daemon.unix, tmp_path, "--workers", 2, "--epochs", 3)
    check(recorded(tmp_path), 3)


def test_lightning_ddp_two_processes(daemon, tmp_path):
    run([sys.executable], "lightning_fit.py", daemon.unix, tmp_path, "--devices", 2,
        "--workers", 2, "--epochs", 2)
    check(recorded(tmp_path), 2, world=2)


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_resumes_from_a_mid_epoch_checkpoint(daemon, tmp_path, devices):
    whole, first, second = (tmp_path / d for d in ("whole", "first", "second"))
    for d in (whole, first, second):
        d.mkdir()
    common = [daemon.unix, "--devices", devices, "--workers", 2, "--epochs", 2, "--stateful"]
    run([sys.executable], "lightning_fit.py", common[0], whole, *common[1:])
    # Checkpoints every 4 steps; the job dies after 9, so the last checkpoint is at step 8 and
    # the 9th step's batch is lost work, trained on again after the resume.
    run([sys.executable], "lightning_fit.py", common[0], first, *common[1:],
        "--ckpt-every", 4, "--stop-after", 9)
    for path in first.glob("ids-*.jsonl"):
        lines = path.read_text().splitlines()
        assert len(lines) == 9
        path.write_text("\n".join(lines[:8]) + "\n")
    run([sys.executable], "lightning_fit.py", common[0], second, *common[1:],
        "--resume", first / "step=8.ckpt")
    resumed = check(recorded(first, second), 2, world=devices)
    assert resumed == check(recorded(whole), 2, world=devices), "as if never interrupted"


@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_prepare_with_its_defaults(daemon, tmp_path, workers):
    run(TORCHRUN, "accelerate_fit.py", daemon.unix, tmp_path, "--workers", workers, "--epochs", 2)
    check(recorded(tmp_path), 2, world=2)


def test_accelerate_with_the_loader_left_out_of_prepare(daemon, tmp_path):
    run(TORCHRUN, "accelerate_fit.py", daemon.unix, tmp_path, "--workers", 2, "--epochs", 2,
        "--no-prepare")
    check(recorded(tmp_path), 2, world=2)


def test_accelerate_without_dispatch_fails_naming_the_setting(daemon, tmp_path):
    out = run(TORCHRUN, "accelerate_fit.py", daemon.unix, tmp_path, "--dispatch-batches", "false",
              fail=True)
    assert out.returncode != 0
    assert "dispatch_batches=False" in out.stderr and "DataLoaderConfiguration" in out.stderr
    assert not list(tmp_path.glob("ids-*.jsonl")), "failed before training on any batch"


@pytest.mark.parametrize("set_epoch", [True, False])
def test_torchrun_with_persistent_workers(daemon, tmp_path, set_epoch):
    run(TORCHRUN, "torchrun_fit.py", daemon.unix, tmp_path, "--epochs", 3, "--persistent",
        *(["--set-epoch"] if set_epoch else []))
    check(recorded(tmp_path), 3, world=2)


@pytest.mark.parametrize("persistent", [True, False])
def test_torchrun_stateful_dataloader_resumes_mid_epoch(daemon, tmp_path, persistent):
    whole, first, second = (tmp_path / d for d in ("whole", "first", "second"))
    for d in (whole, first, second):
        d.mkdir()
    flags = ["--epochs", 2, "--stateful"] + (["--persistent"] if persistent else [])
    run(TORCHRUN, "torchrun_fit.py", daemon.unix, whole, *flags)
    run(TORCHRUN, "torchrun_fit.py", daemon.unix, first, *flags, "--stop-after", 9)
    run(TORCHRUN, "torchrun_fit.py", daemon.unix, second, *flags, "--resume", first)
    assert check(recorded(first, second), 2, world=2) == check(recorded(whole), 2, world=2)


def run_readme_example(tmp_path, launcher, script, *args, env=None):
    """Runs examples/SCRIPT (as the README shows it) on a learnable 512-sample set; returns
    {(epoch, rank): (accuracy, samples)}."""
    import re

    d = quadrant_daemon(tmp_path, 512)
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO / "python"), **(env or {}))
        out = subprocess.run(
            launcher + [str(REPO / "python" / "examples" / script), "--address", d.unix,
                        "--dataset", "quad", "--classes", "4", "--batch-size", "32", "--epochs", "3",
                        *map(str, args)],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)  # checkpoints go there
    finally:
        d.stop()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = re.findall(r"epoch (\d+) rank (\d+): accuracy (\S+) \((\d+) samples", out.stdout)
    return {(int(e), int(r)): (float(a), int(n)) for e, r, a, n in lines}


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_example_learns(tmp_path, devices):
    epochs = run_readme_example(tmp_path, [sys.executable], "lightning_train.py", "--devices", devices)
    assert sorted(epochs) == [(e, r) for e in range(3) for r in range(devices)]
    for r in range(devices):
        assert epochs[(2, r)][0] > 0.9, epochs
        assert epochs[(2, r)][1] == 512 // devices


def test_accelerate_example_learns(tmp_path):
    # torchrun starts the processes (as `accelerate launch` does); Accelerate runs several
    # processes on CPUs only when told to.
    epochs = run_readme_example(tmp_path, TORCHRUN, "accelerate_train.py", env={"ACCELERATE_USE_CPU": "true"})
    assert sorted(epochs) == [(e, r) for e in range(3) for r in range(2)]
    assert all(epochs[(2, r)][0] > 0.9 and epochs[(2, r)][1] == 256 for r in range(2)), epochs


def test_docs_excerpts_are_the_examples_the_tests_run():
    import re

    readme = "\n".join((REPO / p).read_text() for p in ("README.md", "docs/users.md") if (REPO / p).exists())
    blocks = re.findall(r"```python\n# (python/examples/\S+\.py)\n(.*?)```", readme, re.S)
    assert {path for path, _ in blocks} >= {"python/examples/train.py", "python/examples/lightning_train.py",
                                            "python/examples/accelerate_train.py"}
    for path, code in blocks:
        assert code in (REPO / path).read_text(), f"README's excerpt of {path} is not in it"
