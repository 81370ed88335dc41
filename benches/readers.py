"""What a reader process costs: the same files served by the daemon in its own process (an
admin's dataset in the config) and by a reader running as their owner (the same files added by
that user with `larder add`), cold every epoch (no scratch tier, a memory tier of a few
samples), taking turns, in one run.

    sudo PYTHONPATH=python .venv/bin/python benches/readers.py [--rounds 3] [--images 400] [--plot]
        [--before DIR]

With --before DIR (a target/release folder of another build: its larderd and larder), the
same setups run on both builds' daemons, taking turns, and each row says its build.

Needs root (it adds a user, and runs larderd with CAP_SETUID/CAP_SETGID so that it forks the
launcher) and a built target/release/larderd and larder (or --debug). Two datasets: JPEGs of
500x375 through the eval pipeline (resize 256, crop 224), and an HDF5 file of 3x224x224 uint8.
Reports per setup the median us per sample and MB/s of records served, and the reader's cost
against the in-process path.
"""

import argparse
import os
import pathlib
import pwd
import re
import statistics
import subprocess
import sys
import tempfile
import time

import results
from formats import binary

REPO = pathlib.Path(__file__).resolve().parent.parent


def make_jpegs(root: pathlib.Path, n: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(4):
        (root / f"c{c}").mkdir(parents=True)
    for i in range(n):
        # Smooth gradients with noise: photo-like entropy, not pure noise.
        y, x = np.mgrid[0:375, 0:500]
        base = (x * (i % 7 + 1) / 4 + y * (i % 5 + 1) / 3) % 256
        img = np.stack([base, base[::-1], base[:, ::-1]], -1) + rng.normal(0, 12, (375, 500, 3))
        Image.fromarray(img.clip(0, 255).astype("uint8")).save(root / f"c{i % 4}" / f"{i:05}.jpg", quality=90)


def make_hdf5(path: pathlib.Path, n: int) -> None:
    import h5py
    import numpy as np

    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        f["images"] = rng.integers(0, 256, (n, 3, 224, 224), dtype="uint8")
        f["labels"] = np.arange(n, dtype="int64") % 10


def bench(larder: str, socket: pathlib.Path, dataset: str, uid: int) -> tuple:
    """One cold epoch of `dataset` as user `uid`: (samples/s, MB/s)."""
    out = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid if uid else 0}", "--init-groups" if uid else "--clear-groups",
         "--", larder, "--addr", f"unix:{socket}", "bench", dataset, "--epochs", "1", "--clients", "1",
         "--batch-size", "32"],
        capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"larder bench {dataset}: {out.stdout}{out.stderr}")
    m = re.search(r"epoch 0: \d+ samples in [\d.]+s = (\d+) samples/s, ([\d.]+) MB/s", out.stdout)
    if not m:
        sys.exit(f"no epoch line in: {out.stdout}")
    return float(m.group(1)), float(m.group(2))


def start_daemon(root: pathlib.Path, data: pathlib.Path, larderd: str, larder: str, uid: int):
    """A daemon of one build on its own socket: the config's datasets (read in the daemon) and
    the same files added by the user (read by readers as them)."""
    socket = root / "larder.sock"
    config = root / "larder.toml"
    config.write_text(
        f'unix_socket = "{socket}"\nunix_socket_mode = 0o666\nstate_dir = "{root / "state"}"\n'
        f'[scratch]\nenabled = false\n[memory]\nbudget_bytes = 67108864\n'
        f'[[dataset]]\nname = "jpeg-daemon"\nkind = "images"\npath = "{data / "jpegs"}"\n'
        f'[[dataset]]\nname = "hdf5-daemon"\nkind = "hdf5"\npath = "{data / "arrays.h5"}"\n'
        f'samples = "images"\nlabels = "labels"\n')
    daemon = subprocess.Popen([larderd, "--config", str(config)], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not socket.exists():
        if time.time() > deadline or daemon.poll() is not None:
            sys.exit("larderd did not start")
        time.sleep(0.05)
    for name, path, extra in [("jpeg", data / "jpegs", []),
                              ("hdf5", data / "arrays.h5", ["--labels", "labels"])]:
        subprocess.run(["setpriv", f"--reuid={uid}", "--regid=65534", "--init-groups", "--",
                        larder, "--addr", f"unix:{socket}", "add", name, str(path), *extra],
                       check=True, capture_output=True, timeout=600)
    return daemon, socket


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", type=int, default=400)
    p.add_argument("--arrays", type=int, default=400)
    p.add_argument("--debug", action="store_true", help="use target/debug (for a quick look, not for figures)")
    p.add_argument("--before", help="a target/release folder of another build to take turns with")
    results.add_options(p)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: it adds a user and runs the daemon with CAP_SETUID/CAP_SETGID")
    builds = [("this", binary("larderd", args.debug), binary("larder", args.debug))]
    if args.before:
        before = pathlib.Path(args.before)
        builds.append(("before", str(before / "larderd"), str(before / "larder")))
    user = f"lbench{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", "-N", "-g", "nogroup", "-s", "/usr/sbin/nologin", user], check=True)
    daemons = []
    setups = []
    try:
        uid = pwd.getpwnam(user).pw_uid
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            os.chmod(root, 0o755)
            data = root / "data"
            print(f"making {args.images} JPEGs and {args.arrays} arrays...", flush=True)
            make_jpegs(data / "jpegs", args.images)
            make_hdf5(data / "arrays.h5", args.arrays)
            # The user's files, readable by all: the daemon reads them in its own process for
            # the config's datasets, the user's reader for theirs.
            for dirpath, dirs, files in os.walk(data):
                for name in dirs + files:
                    os.chown(os.path.join(dirpath, name), uid, -1)
            os.chown(data, uid, -1)
            sockets = {}
            for build, larderd, larder in builds:
                (root / build).mkdir()
                os.chmod(root / build, 0o755)
                daemon, socket = start_daemon(root / build, data, larderd, larder, uid)
                daemons.append(daemon)
                sockets[build] = (socket, larder)
                setups += [(build, "jpeg", "jpeg-daemon", 0, "in the daemon"),
                           (build, "jpeg", f"{user}/jpeg", uid, "in a reader"),
                           (build, "hdf5", "hdf5-daemon", 0, "in the daemon"),
                           (build, "hdf5", f"{user}/hdf5", uid, "in a reader")]
            runs = {(s[0], s[2]): [] for s in setups}
            for r in range(args.rounds):
                order = setups if r % 2 == 0 else setups[::-1]
                for build, _, name, who, _ in order:
                    socket, larder = sockets[build]
                    runs[(build, name)].append(bench(larder, socket, name, who))
                print(f"round {r + 1}: " + ", ".join(f"{b} {n} {v[-1][0]:.0f}/s" for (b, n), v in runs.items()),
                      flush=True)
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait()
        subprocess.run(["userdel", user], check=False)
    rows = []
    for build, data_kind, name, _, where in setups:
        v = runs[(build, name)]
        per_s = statistics.median(x[0] for x in v)
        mb_s = statistics.median(x[1] for x in v)
        rows.append({"build": build, "data": data_kind, "setup": where, "samples_per_s": per_s,
                     "us_per_sample": 1e6 / per_s, "mb_per_s": mb_s, "rounds": [x[0] for x in v]})
    for build, *_ in builds:
        for kind in ("jpeg", "hdf5"):
            a, b = [r for r in rows if r["data"] == kind and r["build"] == build]
            b["vs_daemon"] = b["samples_per_s"] / a["samples_per_s"]
    if len(builds) > 1:
        for r in rows:
            if r["build"] == "this":
                old = next(o for o in rows if o["build"] == "before" and o["data"] == r["data"]
                           and o["setup"] == r["setup"])
                r["vs_before"] = r["samples_per_s"] / old["samples_per_s"]
    print(f"\n{'build':<7} {'data':<6} {'read and decoded':<16} {'samples/s':>10} {'us/sample':>10} {'MB/s':>8} "
          f"{'vs daemon':>10} {'vs before':>10}")
    for r in rows:
        vs = f"{r['vs_daemon']:.2f}x" if "vs_daemon" in r else ""
        vb = f"{r['vs_before']:.2f}x" if "vs_before" in r else ""
        print(f"{r['build']:<7} {r['data']:<6} {r['setup']:<16} {r['samples_per_s']:>10.0f} "
              f"{r['us_per_sample']:>10.0f} {r['mb_per_s']:>8.1f} {vs:>10} {vb:>10}")
    results.save("readers", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
