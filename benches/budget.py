"""How many samples a memory budget holds, from outside: larderd with a budget of a given share
of a fixed-shape dataset's record bytes (the scratch tier off) streams shuffled epochs of it
until the tier is full; `larder stats` then says how many samples it holds and what each
costs. Run against this build and a build from before (--before PATH), taking turns.

    PYTHONPATH=python .venv/bin/python benches/budget.py --before /tmp/larderd-before [--plot]

The records are 3x64x64 uint8 images and an int64 label, 12,296 bytes each.
"""

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

import results

REPO = pathlib.Path(__file__).resolve().parent.parent
RECORD = 3 * 64 * 64 + 8


def run(larderd: str, root: pathlib.Path, h5: pathlib.Path, share: float, n: int) -> dict:
    socket = root / "larder.sock"
    config = root / "larder.toml"
    budget = int(share * n * RECORD)
    config.write_text(
        f'unix_socket = "{socket}"\n[scratch]\nenabled = false\n[memory]\nbudget_bytes = {budget}\n'
        f'[[dataset]]\nname = "d"\npath = "{h5}"\nlabels = "labels"\n')
    socket.unlink(missing_ok=True)
    daemon = subprocess.Popen([larderd, "--config", str(config)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not socket.exists():
            if time.time() > deadline or daemon.poll() is not None:
                sys.exit(f"{larderd} did not start")
            time.sleep(0.05)
        sys.path.insert(0, str(REPO / "python"))
        import larder

        with larder.Client(f"unix:{socket}") as c:
            for epoch in range(3):
                for _ in c.stream("d", 256, seed=1, epoch=epoch, transport="bytes"):
                    pass
            s = c.stats()
        return {"budget": budget, "samples": s.memory_entries, "bytes": s.memory_bytes,
                "held_share": s.memory_entries / n,
                "bytes_per_sample": s.memory_bytes / max(1, s.memory_entries)}
    finally:
        daemon.terminate()
        daemon.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="a larderd built before the change")
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=2)
    results.add_options(p)
    args = p.parse_args()
    after = str(REPO / "target" / "release" / "larderd")
    builds = {"before": args.before, "this": after}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        h5 = root / "d.h5"
        with h5py.File(h5, "w") as f:
            rng = np.random.default_rng(0)
            f.create_dataset("images", data=rng.integers(0, 256, (args.samples, 3, 64, 64), dtype=np.uint8))
            f.create_dataset("labels", data=np.arange(args.samples, dtype=np.int64))
        for share in (0.5, 1.0):
            got = {k: [] for k in builds}
            for r in range(args.rounds):
                for name in (builds if r % 2 == 0 else list(builds)[::-1]):
                    got[name].append(run(builds[name], root, h5, share, args.samples))
            for name, runs in got.items():
                best = max(runs, key=lambda x: x["samples"])
                rows.append({"build": name, "budget_share": share, **best})
                print(f"budget {share:.0%} of the records: {name:>6} holds {best['samples']} samples "
                      f"({best['held_share']:.1%}), {best['bytes_per_sample']:.0f} bytes a sample", flush=True)
    results.save("budget", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
