"""What one user can cost another's work on a shared daemon: real users alice and bob, the
release build as root with users' datasets read by readers as their owners (the shipped
configuration), and bob trying, one at a time and then all at once, what a user may do to the
service (python/tests/tenants.py): 3,000 connections sending only the HTTP/2 preface,
PlanStream floods at batch size 1, cold epochs of his own folders, the same with his readers
stopped and let go in a loop, a ring the size of the rings' budget and 32 datasets of 134 M
rows that cost no disk. Meanwhile alice adds her folder of photos (a new name each time: a cold
epoch), streams an epoch, lists the datasets and asks for a ring; every condition once a round,
taking turns with bob idle, in one run.

    sudo PYTHONPATH=python .venv/bin/python benches/tenancy.py [--rounds 3] [--images 800] [--plot]

Needs root (it adds the two users) and target/release/larderd and larder (or --debug). Reports
per condition the median over rounds of alice's cold epoch (seconds, and against bob idle),
her add and listing (seconds), whether her ring was granted, and the daemon's peak anonymous
memory against its ceiling.
"""

import argparse
import os
import pathlib
import statistics
import sys
import threading
import time

import results

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python" / "tests"))
import test_tenancy as t  # noqa: E402  (the users, files and processes the test uses)

CONDITIONS = ["bob idle", "connections", "PlanStream flood", "his cold epochs",
              "his cold epochs, readers stopped", "ring and sparse datasets", "all at once"]


def attacks(condition: str, bob: int, socket, bn: str, root: pathlib.Path, seconds: float) -> list:
    """bob's processes for `condition`, started."""
    a = []
    if condition in ("connections", "all at once"):
        a.append(t.tenant(bob, "connections", socket, 3000, seconds))
    if condition in ("PlanStream flood", "all at once"):
        a.append(t.tenant(bob, "plans", socket, f"{bn}/small", seconds))
    if condition in ("his cold epochs", "his cold epochs, readers stopped", "all at once"):
        a.append(t.tenant(bob, "epochs", socket, seconds, f"{bn}/pics0", f"{bn}/pics1"))
    if condition in ("his cold epochs, readers stopped", "all at once"):
        a.append(t.tenant(bob, "stop", seconds))
    if condition in ("ring and sparse datasets", "all at once"):
        a.append(t.tenant(bob, "ring", socket, t.BUDGET // 2 - (1 << 20)))
        for k in range(32):
            a.append(t.as_user(bob, [str(t.larder_binary()), "--addr", f"unix:{socket}", "add",
                                     f"sparse{k}-{time.monotonic_ns()}", str(root / "bob" / f"sparse{k}.npy")]))
    return a


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", type=int, default=800)
    p.add_argument("--seconds", type=float, default=12, help="how long each of bob's attacks lasts")
    p.add_argument("--debug", action="store_true", help="use target/debug (for a quick look, not for figures)")
    results.add_options(p)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: it adds users alice and bob")
    build = "debug" if args.debug else "release"
    os.environ["LARDERD_BIN"] = str(REPO / "target" / build / "larderd")
    os.environ["LARDER_BIN"] = str(REPO / "target" / build / "larder")
    users = t.Users()
    import tempfile

    work = pathlib.Path(tempfile.mkdtemp(prefix="larder-tenancy-bench-"))
    work.chmod(0o755)
    rows, runs = [], []
    try:
        alice, bob = users.uid["alice"], users.uid["bob"]
        an, bn = users.names["alice"], users.names["bob"]
        for who, uid in (("alice", alice), ("bob", bob)):
            (work / who).mkdir()
            os.chown(work / who, uid, -1)
            (work / who).chmod(0o700)
        t.jpegs(work / "alice" / "pics", args.images, alice, size=(500, 375))
        for k in range(2):
            t.jpegs(work / "bob" / f"pics{k}", args.images // 2, bob, size=(500, 375))
        import numpy as np

        small = work / "bob" / "small.npy"
        np.save(small, np.zeros((200_000, 4), np.uint8))
        os.chown(small, bob, -1)
        for k in range(32):
            t.sparse_npy(work / "bob" / f"sparse{k}.npy", 134_217_728, bob)
        daemon, socket = t.start_daemon(work)
        try:
            for k in range(2):
                t.larder_as(bob, socket, "add", f"pics{k}", str(work / "bob" / f"pics{k}"))
            t.larder_as(bob, socket, "add", "small", str(small))
            for r in range(args.rounds):
                for condition in CONDITIONS:
                    started = attacks(condition, bob, socket, bn, work, args.seconds) if condition != "bob idle" else []
                    peak = [0]
                    watching = threading.Event()

                    def watch():
                        while not watching.is_set():
                            try:
                                peak[0] = max(peak[0], int(t.status_of(daemon.pid, "RssAnon").split()[0]) * 1024)
                            except (OSError, IndexError, ValueError):
                                pass
                            time.sleep(0.1)

                    watcher = threading.Thread(target=watch)
                    watcher.start()
                    if started:
                        time.sleep(1.5)
                    name = f"p{r}{CONDITIONS.index(condition)}"
                    began = time.monotonic()
                    rc, out = t.larder_as(alice, socket, "add", name, str(work / "alice" / "pics"))
                    add = time.monotonic() - began
                    if rc != 0:
                        sys.exit(f"alice's add: {out}")
                    epoch = t.result(t.tenant(alice, "epoch", socket, f"{an}/{name}"))
                    listed = t.result(t.tenant(alice, "list", socket))
                    for a in started:
                        a.communicate(timeout=300)
                    watching.set()
                    watcher.join()
                    if daemon.poll() is not None:
                        sys.exit(f"the daemon ended during {condition!r}")
                    with __import__("larder").Client(f"unix:{socket}") as c:
                        ceiling = c.stats().anonymous_ceiling_bytes
                    run = {"round": r, "condition": condition, "epoch_s": epoch["seconds"],
                           "exact": epoch["samples"] == epoch["distinct"] == args.images,
                           "add_s": add, "list_s": listed["seconds"], "ring": epoch["ring"]["granted"],
                           "peak_anon_mb": peak[0] / 1e6, "ceiling_mb": ceiling / 1e6}
                    runs.append(run)
                    print(f"round {r} {condition:34s} epoch {epoch['seconds']:6.2f} s  add {add:5.2f} s  "
                          f"list {listed['seconds']:5.3f} s  ring {epoch['ring']['granted']}  "
                          f"exact {run['exact']}  peak {peak[0] / 1e6:6.0f} MB", flush=True)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    finally:
        users.remove()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    idle = statistics.median(r["epoch_s"] for r in runs if r["condition"] == "bob idle")
    print(f"\n{'condition':34s} {'epoch s':>8s} {'x idle':>7s} {'add s':>6s} {'list s':>7s} {'ring':>5s} "
          f"{'exact':>6s} {'peak anon MB':>13s} {'ceiling MB':>11s}")
    for condition in CONDITIONS:
        mine = [r for r in runs if r["condition"] == condition]
        row = {
            "condition": condition,
            "epoch_s": statistics.median(r["epoch_s"] for r in mine),
            "add_s": statistics.median(r["add_s"] for r in mine),
            "list_s": statistics.median(r["list_s"] for r in mine),
            "ring_granted": all(r["ring"] for r in mine),
            "exact": all(r["exact"] for r in mine),
            "peak_anon_mb": max(r["peak_anon_mb"] for r in mine),
            "ceiling_mb": min(r["ceiling_mb"] for r in mine),
        }
        row["vs_idle"] = row["epoch_s"] / idle
        rows.append(row)
        print(f"{condition:34s} {row['epoch_s']:8.2f} {row['vs_idle']:7.2f} {row['add_s']:6.2f} "
              f"{row['list_s']:7.3f} {str(row['ring_granted']):>5s} {str(row['exact']):>6s} "
              f"{row['peak_anon_mb']:13.0f} {row['ceiling_mb']:11.0f}")
    results.save("tenancy", args, rows, runs=runs, images=args.images)
    return 0


if __name__ == "__main__":
    sys.exit(main())
