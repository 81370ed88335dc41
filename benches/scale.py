"""What a dataset costs the daemon as it grows: NumPy datasets of N rows of 16 uint8 (sparse
files: the bytes do not matter), N from 10^4 to 10^7, each added by a user (read by a reader as
them, as the package ships it) to a fresh daemon with no scratch tier. For each N:
  - the daemon's anonymous memory before and after the dataset opens, per sample;
  - the time from a stream's request to its first batch (batches of 256), and the daemon's
    peak anonymous memory while it starts;
  - a `PlanStream` of the whole epoch at batch size 1 (what a loader's `len()` asks), its time;
  both in the computed order (form 2, the client's default) and then in the listed one of
  clients before forms (form 1), on the same daemon.

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


def image_tree(root: pathlib.Path, n: int, classes: int = 1000) -> None:
    """n copies of one small JPEG (16x16) in `classes` class folders, named as ImageNet's are,
    world-readable; kept between runs (made once: a marker beside it says it is whole)."""
    marker = root.with_name(root.name + ".complete")
    if marker.exists():
        return
    import io
    import shutil

    from PIL import Image

    shutil.rmtree(root, ignore_errors=True)
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 80, 40)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    dirs = [root / f"n{c:08d}" for c in range(classes)]
    for d in dirs:
        d.mkdir(parents=True, mode=0o755)
    for i in range(n):
        c = i % classes
        with open(dirs[c] / f"n{c:08d}_{i}.JPEG", "wb") as f:
            f.write(jpeg)
    os.chmod(root, 0o755)
    marker.touch()


def memfd_bytes(pid: int, name: str) -> int:
    """Bytes of the memfds named `name` the process holds (a reader's walk: shared memory, not in
    its anonymous memory)."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{name}"):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_size
        except OSError:
            pass
    return total


def walk_stat(root: str) -> int:
    """What larder needs of a folder: every entry, and a stat of each file (its size and
    stamps), by os.scandir."""
    count = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    e.stat()
                    count += 1
    return count


def images_part(args, user: str, uid: int) -> list:
    """The image-folder rows: for each N, the walk by os.scandir with a stat of each file,
    torchvision's ImageFolder constructor, and larder's open (added by the user, read by a reader
    as them), reopen after a restart, memory per file, first batch and PlanStream."""
    import larder

    rows = []
    sizes = [n for n in (10_000, 100_000, 1_000_000, 1_280_000) if n <= args.images_max]
    for n in sizes:
        tree = pathlib.Path(args.images_dir) / f"imagefolder-{n}"
        t = time.perf_counter()
        image_tree(tree, n)
        made = time.perf_counter() - t
        t = time.perf_counter()
        assert walk_stat(str(tree)) == n
        scandir_s = time.perf_counter() - t
        folder_s = None
        try:
            from torchvision.datasets import ImageFolder

            t = time.perf_counter()
            assert len(ImageFolder(str(tree))) == n
            folder_s = time.perf_counter() - t
        except ImportError:
            pass
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            os.chmod(root, 0o755)
            sock = root / "larder.sock"
            (root / "larder.toml").write_text(
                f'unix_socket = "{sock}"\nunix_socket_mode = 0o666\nstate_dir = "{root / "state"}"\n'
                "[scratch]\nenabled = false\n")

            def start():
                d = subprocess.Popen([args.larderd, "--config", str(root / "larder.toml")], stderr=subprocess.DEVNULL)
                while not sock.exists():
                    time.sleep(0.01)
                return d

            d = start()
            try:
                time.sleep(0.5)
                idle = anon_kb(d.pid)
                t = time.perf_counter()
                subprocess.run(["setpriv", f"--reuid={uid}", "--regid=65534", "--clear-groups", args.larder,
                                "--addr", f"unix:{sock}", "add", "pics", str(tree), "--resize", "16", "--crop", "16"],
                               check=True, capture_output=True, timeout=1800)
                opened = time.perf_counter() - t
                time.sleep(0.5)
                open_kb = anon_kb(d.pid)
                walk_bytes = memfd_bytes(d.pid, "larder-walk")
                name = f"{user}/pics"
                with larder.Client(f"unix:{sock}") as c:
                    t = time.perf_counter()
                    next(iter(c.stream(name, 256, seed=1, transport="bytes")))
                    first = time.perf_counter() - t
                    t = time.perf_counter()
                    c.plan(name, 1, seed=1)
                    plan = time.perf_counter() - t
            finally:
                d.terminate()
                d.wait()
            # Restarted: the user's dataset is opened again from the state the daemon kept.
            t = time.perf_counter()
            d = start()
            try:
                with larder.Client(f"unix:{sock}", reconnect_timeout=1800) as c:
                    while True:
                        try:
                            c.plan(f"{user}/pics", 256, seed=1)
                            break
                        except larder.LarderError as e:
                            if "being opened" not in str(e):
                                raise
                            time.sleep(0.02)
                reopened = time.perf_counter() - t
            finally:
                d.terminate()
                d.wait()
        row = {"files": n, "made_s": made, "scandir_stat_s": scandir_s, "imagefolder_s": folder_s,
               "open_s": opened, "open_over_scandir": opened / scandir_s, "reopen_s": reopened,
               "bytes_per_file_open": (open_kb - idle) * 1024 / n, "walk_bytes_per_file": walk_bytes / n,
               "first_batch_ms": first * 1e3,
               "plan_ms": plan * 1e3}
        rows.append(row)
        print(f"{n:>10} files: scandir+stat {scandir_s:.2f} s, ImageFolder "
              f"{'-' if folder_s is None else f'{folder_s:.2f} s'}; larder open {opened:.2f} s "
              f"({row['open_over_scandir']:.2f}x), reopen after a restart {reopened:.2f} s, "
              f"{row['bytes_per_file_open']:.1f} B/file open + its walk {row['walk_bytes_per_file']:.1f} B/file, first batch {first * 1e3:.0f} ms, "
              f"PlanStream {plan * 1e3:.0f} ms", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--larderd", default=str(REPO / "target" / "release" / "larderd"))
    p.add_argument("--larder", default=str(REPO / "target" / "release" / "larder"))
    p.add_argument("--max", type=int, default=10_000_000)
    p.add_argument("--parts", default="npy,images", help="which parts to run: npy, images")
    p.add_argument("--images-max", type=int, default=1_280_000)
    p.add_argument("--images-dir", default="/var/tmp/larder-scale",
                   help="where the image trees are made (kept between runs)")
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
        sizes = [n for n in (10_000, 100_000, 1_000_000, 10_000_000)
                 if n <= args.max and "npy" in args.parts.split(",")]
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
                    # Streamed by root (who may read every dataset; the reader still reads it),
                    # in the computed order (form 2, the client's default), then in the listed
                    # one of clients before forms (form 1), the daemon's peak reset between.
                    row = {"samples": n, "open_s": opened, "idle_mb": idle / 1024, "open_mb": open_kb / 1024,
                           "bytes_per_sample_open": (open_kb - idle) * 1024 / n}
                    with larder.Client(f"unix:{sock}") as c:
                        name = f"{user}/rows"
                        for form in (2, 1):
                            peak[0] = 0
                            t = time.perf_counter()
                            s = iter(c.stream(name, 256, seed=1, transport="bytes", order_version=form))
                            next(s)
                            first = time.perf_counter() - t
                            del s
                            start_peak = peak[0]
                            time.sleep(0.5)
                            peak[0] = 0
                            t = time.perf_counter()
                            c.plan(name, 1, seed=1, order_version=form)
                            plan = time.perf_counter() - t
                            plan_peak = peak[0]
                            time.sleep(0.5)
                            k = "" if form == 2 else "v1_"
                            row.update({f"{k}first_batch_ms": first * 1e3, f"{k}start_peak_mb": start_peak / 1024,
                                        f"{k}start_added_mb": (start_peak - open_kb) / 1024,
                                        f"{k}plan_ms": plan * 1e3, f"{k}plan_peak_mb": plan_peak / 1024,
                                        f"{k}plan_added_mb": (plan_peak - open_kb) / 1024})
                    stop.set()
                    rows.append(row)
                    print(f"{n:>10} samples: open {opened:.2f} s, {row['bytes_per_sample_open']:.2f} B/sample open; "
                          f"first batch {row['first_batch_ms']:.0f} ms (+{row['start_added_mb']:.0f} MB); "
                          f"PlanStream {row['plan_ms']:.0f} ms (+{row['plan_added_mb']:.0f} MB); form 1: first batch "
                          f"{row['v1_first_batch_ms']:.0f} ms (+{row['v1_start_added_mb']:.0f} MB), PlanStream "
                          f"{row['v1_plan_ms']:.0f} ms (+{row['v1_plan_added_mb']:.0f} MB)", flush=True)
                finally:
                    d.terminate()
                    d.wait()
        images = images_part(args, user, uid) if "images" in args.parts.split(",") else []
    finally:
        subprocess.run(["userdel", user])
    results.save("scale", args, rows, tables={"images": images})
    return 0


if __name__ == "__main__":
    sys.exit(main())
