"""The seed notes' own case: a grid search of concurrent jobs on an image folder whose
preprocessed samples do not fit in memory, larder against torchvision, in the same confinement.

    PYTHONPATH=python .venv/bin/python benches/gridsearch.py [--larderd target/release/larderd]
        [--images 6000] [--jobs 3] [--epochs 3] [--cgroup-mb 2500] [--memory-share 0.35]
        [--one-seed] [--out benches/results] [--plot]
    PYTHONPATH=python .venv/bin/python benches/gridsearch.py --images 60 --jobs 1 --epochs 2   (smoke)

As root (it makes memory cgroups and drops the page cache; it says so and stops otherwise). It
writes --images JPEGs of 500x375 in 10 classes (about 56 kB each; 262 kB each once decoded and
resized to 256 on the shorter side: 1.6 GB for 6,000), then runs, one after the other, each in a
fresh memory cgroup of --cgroup-mb (v1 or v2), the page cache dropped first:
  - torchvision: --jobs processes, each ImageFolder with its train recipe
    (RandomResizedCrop(224) + RandomHorizontalFlip + PILToTensor), DataLoader(batch_size=128,
    shuffle=True, num_workers=2, persistent_workers=True): what each job of a grid search
    runs today;
  - larder: a fresh larderd (empty scratch tier, on this disk) and --jobs processes, each
    streaming the folder's train pipeline (random-resized crop + flip) in shared memory, the
    recommended setup, seeds 1000 + j (or all 42 with --one-seed). The memory tier holds
    --memory-share of the preprocessed samples (its budget is that, plus the jobs' rings, which
    count in it), so most of every epoch after the first comes from the scratch tier on disk:
    the cgroup is too small for the page cache to hold it.
All jobs of a run start together and run --epochs epochs. Each job checks every epoch holds
every image exactly once (larder: by the sample ids; torchvision: by the count), and the bench
fails otherwise. Per epoch, the table gives the jobs' samples/s added up, and larder's ratio to
torchvision's.

The figures go to --out (see benches/results.py): gridsearch.json and gridsearch.csv (with
--one-seed gridsearch-one-seed.*, so the two runs of the table stay side by side), a row per
epoch (both rates and the ratio), larder's lookups per tier in the JSON; --plot draws the PNG:
each epoch's samples/s, larder against torchvision.
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
import results  # noqa: E402

BATCH = 128
RECORD = 3 * 256 * 341 + 8  # a 500x375 image at 256 on the shorter side, and its label
RING = 9 * (BATCH * 3 * 224 * 224 + 8192) + 4096  # a job's ring (docs/users.md, "Shared memory")


def emit(**event):
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def job_torchvision(folder: str, epochs: int) -> None:
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.PILToTensor()])
    ds = datasets.ImageFolder(folder, transform=tf)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
    emit(event="ready")
    sys.stdin.readline()
    for e in range(epochs):
        t, n = time.perf_counter(), 0
        for images, labels in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, 224, 224)
            n += images.shape[0]
        seconds = time.perf_counter() - t
        emit(event="epoch", epoch=e, samples=n, seconds=seconds, exact=n == len(ds))


def job_larder(address: str, seed: int, epochs: int, n: int) -> None:
    import numpy as np

    import larder

    with larder.Client(address) as client:
        client.dataset("pics")
        emit(event="ready")
        sys.stdin.readline()
        for e in range(epochs):
            t, ids = time.perf_counter(), []
            for b in client.stream("pics", BATCH, seed=seed, epoch=e, pipeline="train"):
                images, labels = b.torch()
                assert images.shape[1:] == (3, 224, 224)
                ids.append(b.sample_ids.copy())
                del images, labels, b
            seconds = time.perf_counter() - t
            got = np.sort(np.concatenate(ids))
            emit(event="epoch", epoch=e, samples=len(got), seconds=seconds,
                 exact=bool(np.array_equal(got, np.arange(n))))


def make_cgroup(name: str, limit: int) -> pathlib.Path:
    from delivery import make_cgroup as make

    return make(name, limit)


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    pathlib.Path("/proc/sys/vm/drop_caches").write_text("3")


def run_jobs(procs_file, argvs, env, tag):
    """Starts the jobs in the cgroup, lets them go together; returns each one's epoch events."""
    procs = [subprocess.Popen(["sh", "-c", f'echo $$ > {procs_file} && exec "$@"', "sh", *map(str, argv)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for argv in argvs]
    try:
        for j, p in enumerate(procs):
            line = p.stdout.readline()
            if '"ready"' not in line:
                raise SystemExit(f"{tag} job {j} did not start (said {line!r})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for j, p in enumerate(procs):
            text, _ = p.communicate(timeout=3600)
            events = [json.loads(x) for x in text.splitlines() if x.strip()]
            if p.returncode != 0:
                raise SystemExit(f"{tag} job {j} failed with {p.returncode}")
            bad = [e for e in events if not e["exact"]]
            if bad:
                raise SystemExit(f"{tag} job {j}: epoch {bad[0]['epoch']} did not hold every image once")
            out.append(events)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def per_epoch(jobs, epochs):
    """Samples/s of all jobs together, per epoch (each job's rate, added up)."""
    return [sum(j[e]["samples"] / j[e]["seconds"] for j in jobs) for e in range(epochs)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", str(REPO / "target/release/larderd")))
    p.add_argument("--images", type=int, default=6000)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--cgroup-mb", type=int, default=2500)
    p.add_argument("--memory-share", type=float, default=0.35)
    p.add_argument("--one-seed", action="store_true")
    p.add_argument("--dir", help="work here (default: a temporary folder on this disk)")
    p.add_argument("--job", nargs="+", help=argparse.SUPPRESS)
    results.add_options(p)
    args = p.parse_args()
    if args.job:
        kind, *rest = args.job
        if kind == "torchvision":
            job_torchvision(rest[0], int(rest[1]))
        else:
            job_larder(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
        return 0
    if os.geteuid() != 0:
        print("benches/gridsearch.py needs root: it makes memory cgroups and drops the page cache "
              "(run it with sudo, or as root)")
        return 2
    from images import write_folder

    tmp = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="larder-grid-", dir=str(REPO / "target")))
    tmp.mkdir(parents=True, exist_ok=True)
    folder = tmp / "pics"
    if not folder.exists():
        t = time.perf_counter()
        disk = write_folder(folder, args.images)
        print(f"{args.images} JPEGs of 500x375, {disk / 1e6:.0f} MB ({time.perf_counter() - t:.0f} s to write); "
              f"{args.images * RECORD / 1e6:,.0f} MB preprocessed", flush=True)
    limit = args.cgroup_mb << 20
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    seeds = [42] * args.jobs if args.one_seed else [1000 + j for j in range(args.jobs)]

    drop_page_cache()
    procs = make_cgroup("larder-grid-torchvision", limit)
    tv = run_jobs(procs, [[sys.executable, HERE, "--job", "torchvision", folder, args.epochs]
                          for _ in range(args.jobs)], env, "torchvision")
    tv_rates = per_epoch(tv, args.epochs)
    print("torchvision:", ", ".join(f"{r:,.0f}/s" for r in tv_rates), flush=True)

    drop_page_cache()
    procs = make_cgroup("larder-grid-larder", limit)
    run = tmp / "larder"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    sock = run / "larder.sock"
    # + the message path's share (64 MiB, set below), held back from the tier.
    budget = int(args.memory_share * args.images * (RECORD + 192)) + args.jobs * RING + (64 << 20)
    (run / "larder.toml").write_text(
        f'unix_socket = "{sock}"\n[scratch]\ndir = "{run / "scratch"}"\n'
        f"[memory]\nbudget_bytes = {budget}\nmessage_bytes = {64 << 20}\n"
        f'[[dataset]]\nname = "pics"\nkind = "images"\npath = "{folder}"\nresize = 256\ncrop = 224\n'
        "[dataset.train]\n"
    )
    log = open(run / "larderd.log", "wb")
    daemon = subprocess.Popen(["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", args.larderd,
                               "--config", str(run / "larder.toml")], stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"larderd did not start; see {log.name}")
            time.sleep(0.05)
        address = f"unix:{sock}"
        ld = run_jobs(procs, [[sys.executable, HERE, "--job", "larder", address, s, args.epochs, args.images]
                              for s in seeds], env, "larder")
        import larder

        with larder.Client(address) as c:
            st = c.stats()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait()
    ld_rates = per_epoch(ld, args.epochs)
    print("larder:", ", ".join(f"{r:,.0f}/s" for r in ld_rates), flush=True)
    tiers = {t.tier: t.hits for t in st.tiers}
    lookups = sum(tiers.values()) or 1
    print(f"\n{args.jobs} jobs ({'one seed' if args.one_seed else 'distinct seeds'}), {args.epochs} epochs, "
          f"{args.images:,} JPEGs ({args.images * RECORD / 1e6:,.0f} MB preprocessed), every job and larderd "
          f"in a memory cgroup of {args.cgroup_mb:,} MB; larder's memory tier {budget / 1e6:,.0f} MB "
          f"({args.memory_share:.0%} of the samples, and the rings)")
    print("| epoch | torchvision ImageFolder x" + str(args.jobs) + " (train recipe, 2 workers each) | larder x"
          + str(args.jobs) + " (train pipeline, recommended) | larder / torchvision |")
    print("|---|---|---|---|")
    for e in range(args.epochs):
        name = f"{e + 1}" + (" (cold)" if e == 0 else "")
        print(f"| {name} | {tv_rates[e]:,.0f}/s | {ld_rates[e]:,.0f}/s | **{ld_rates[e] / tv_rates[e]:.2f}x** |")
    print(f"larder's lookups: memory {tiers.get('memory', 0) / lookups:.0%}, scratch "
          f"{tiers.get('scratch', 0) / lookups:.0%}, raw {tiers.get('raw', 0) / lookups:.0%}; every job got every "
          "image exactly once per epoch")
    results.save("gridsearch", args, [
        {"epoch": e + 1, "cold": e == 0, "torchvision_per_s": tv_rates[e], "larder_per_s": ld_rates[e],
         "ratio": ld_rates[e] / tv_rates[e]} for e in range(args.epochs)
    ], name="gridsearch-one-seed" if args.one_seed else "gridsearch",
        lookups={t: tiers.get(t, 0) for t in ("memory", "scratch", "raw")}, memory_tier_bytes=budget,
        preprocessed_bytes=args.images * RECORD)
    if not args.dir:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
