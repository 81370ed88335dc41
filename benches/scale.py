"""What a dataset costs the daemon as it grows: NumPy datasets of N rows of 16 uint8 (sparse
files: the bytes do not matter), N from 10^4 to 10^7, each added by a user (read by a reader as
them, as the package ships it) to a fresh daemon with no scratch tier. For each N:
  - the daemon's anonymous memory before and after the dataset opens, per sample;
  - the time from a stream's request to its first batch (batches of 256), and the daemon's
    peak anonymous memory while it starts;
  - a `PlanStream` of the whole epoch at batch size 1 (what a loader's `len()` asks), its time.

    PYTHONPATH=python .venv/bin/python benches/scale.py [--max 10000000] [--plot]    # as root

Needs root (a user of its own, readers) and a built target/release/larderd. The figures go to
--out as scale.json and scale.csv.
"""

import argparse
import os
import pathlib
import pwd
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import results

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))


def anon_kb(pid: int) -> int:
    """The process's anonymous resident memory (RssAnon), kB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def sparse_npy(path: pathlib.Path, n: int) -> None:
    """An .npy of n rows of 16 uint8, its data a hole (no disk used)."""
    header = "{'descr': '|u1', 'fortran_order': False, 'shape': (%d, 16), }" % n
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
        f.truncate(f.tell() + 16 * n)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--larderd", default=str(REPO / "target" / "release" / "larderd"))
    p.add_argument("--larder", default=str(REPO / "target" / "release" / "larder"))
    p.add_argument("--max", type=int, default=10_000_000)
    results.add_options(p)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("scale.py needs root (a user of its own; readers as them)")
    user = f"lscale{os.getpid()}"
    subprocess.run(["useradd", "-M", "-N", "-g", "nogroup", "-s", "/usr/sbin/nologin", user], check=True)
    uid = pwd.getpwnam(user).pw_uid
    rows = []
    larder_cli = args.larder
    import larder
    try:
        sizes = [n for n in (10_000, 100_000, 1_000_000, 10_000_000) if n <= args.max]
        for n in sizes:
            with tempfile.TemporaryDirectory() as tmp:
                root = pathlib.Path(tmp)
                os.chmod(root, 0o755)
                data = root / "data"
                data.mkdir()
                sparse_npy(data / "rows.npy", n)
                os.chown(data, uid, -1)
                os.chown(data / "rows.npy", uid, -1)
                sock = root / "larder.sock"
                (root / "larder.toml").write_text(
                    f'unix_socket = "{sock}"\nunix_socket_mode = 0o666\nstate_dir = "{root / "state"}"\n'
                    "[scratch]\nenabled = false\n")
                d = subprocess.Popen([args.larderd, "--config", str(root / "larder.toml")], stderr=subprocess.DEVNULL)
                try:
                    while not sock.exists():
                        time.sleep(0.05)
                    time.sleep(0.5)
                    idle = anon_kb(d.pid)
                    # Added by its owner (the CLI as them): read by a reader as them.
                    t = time.perf_counter()
                    subprocess.run(["setpriv", f"--reuid={uid}", "--regid=65534", "--clear-groups", larder_cli,
                                    "--addr", f"unix:{sock}", "add", "rows", str(data / "rows.npy")],
                                   check=True, capture_output=True, timeout=600)
                    opened = time.perf_counter() - t
                    time.sleep(0.5)
                    open_kb = anon_kb(d.pid)
                    peak = [0]
                    stop = threading.Event()

                    def watch():
                        while not stop.is_set():
                            peak[0] = max(peak[0], anon_kb(d.pid))
                            time.sleep(0.005)

                    threading.Thread(target=watch, daemon=True).start()
                    # Streamed by root (who may read every dataset; the reader still reads it).
                    with larder.Client(f"unix:{sock}") as c:
                        name = f"{user}/rows"
                        t = time.perf_counter()
                        s = iter(c.stream(name, 256, seed=1, transport="bytes"))
                        next(s)
                        first = time.perf_counter() - t
                        del s
                        start_peak = peak[0]
                        time.sleep(0.5)
                        peak[0] = 0
                        t = time.perf_counter()
                        c.plan(name, 1, seed=1)
                        plan = time.perf_counter() - t
                        plan_peak = peak[0]
                    stop.set()
                    row = {"samples": n, "open_s": opened, "idle_mb": idle / 1024, "open_mb": open_kb / 1024,
                           "bytes_per_sample_open": (open_kb - idle) * 1024 / n,
                           "first_batch_ms": first * 1e3, "start_peak_mb": start_peak / 1024,
                           "start_added_mb": (start_peak - open_kb) / 1024,
                           "plan_ms": plan * 1e3, "plan_peak_mb": plan_peak / 1024,
                           "plan_added_mb": (plan_peak - open_kb) / 1024}
                    rows.append(row)
                    print(f"{n:>10} samples: open {opened:.2f} s, {row['bytes_per_sample_open']:.2f} B/sample open; "
                          f"first batch {row['first_batch_ms']:.0f} ms (+{row['start_added_mb']:.0f} MB); "
                          f"PlanStream {row['plan_ms']:.0f} ms (+{row['plan_added_mb']:.0f} MB)", flush=True)
                finally:
                    d.terminate()
                    d.wait()
    finally:
        subprocess.run(["userdel", user])
    results.save("scale", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
