"""A soak anyone can run: larderd under churning clients for N minutes, its memory, descriptors
and threads sampled every few seconds, every completed epoch checked for exactly once.

    PYTHONPATH=python .venv/bin/python benches/soak.py [--larderd target/release/larderd]
        [--minutes 10] [--sample-seconds 0.5] [--stats-seconds 1] [--dir DIR]
        [--out benches/results] [--plot]
    PYTHONPATH=python .venv/bin/python benches/soak.py --minutes 0.5   (smoke; too short for the
        flatness target, which needs two windows of 30 s after the first third: exit status 1)

It writes four datasets under --dir (default: a temporary folder; about 20 s):
  - h5: HDF5, 5,000 uint8 images 3x64x64 (contiguous) and int64 labels, a [dataset.train]
    (pad 4, random crop, flip);
  - h5gz: the same shape and train pipeline, stored in gzip chunks;
  - clips: HDF5, 3,000 variable-length int16 clips (h5py vlen, 0 to 4,000 values) and a label,
    as `[[dataset.field]]` tables;
  - pics: an image folder of 600 JPEGs in 4 class subfolders, 200x150 to 500x375,
    `resize = 96`, `crop = 64` and a `[dataset.train]` (random-resized crop, flip);
and starts larderd (--larderd) on a Unix socket with a memory budget of 194 MB that the memory
tier, the shared-memory rings (at most half of it) and the message path (its default share, a
quarter) share, so the tier holds less than the data as the rings grow, and a scratch folder
beside the data. Clients, each an OS process of its own (this file
with --client KIND), loop until the deadline, each stream with a batch size of its own drawn
from 1..512 (in turn from each of 8 strata), its own seed and epoch, its dataset and pipeline
dealt from a shuffled deck of the client's mix (so every minute sees the same mix):
  - shm (2 processes): whole epochs through shared-memory rings, h5/h5gz/pics, eval or train;
  - bytes: whole epochs in the gRPC messages, h5/h5gz/pics, eval or train;
  - clips: whole epochs of the variable-length clips (the message path), the padded and the
    offsets layout in turn;
  - cancel: streams of any dataset and transport dropped after 1 to 3 batches;
  - victim: a client doing shm or bytes epochs that the parent SIGKILLs after 1 to 4 s, then
    starts again, for the whole run.
Clients drop their larder.Client (its channel and rings) and make a new one now and then.
Every epoch a client completes is checked: its sample ids, sorted, are 0..N-1, and the data is
the sample's (labels always; pixels of the HDF5 images in eval; every value of every clip).

Every --sample-seconds the parent prints one line: the daemon's anonymous, resident and shared
memory (/proc/PID/status RssAnon, VmRSS, RssShmem), descriptors (/proc/PID/fd), threads, and
what the daemon accounts (GetStats: anonymous_bytes, its ceiling, accounted_bytes, memory
tier, rings, spare and in-flight message buffers, the allocator's free pages, resident_bytes) and its open streams. At the
deadline it stops the clients (they stop by themselves; SIGTERM, then SIGKILL, for any that
does not), waits until the daemon has freed its idle message buffers (it does after 10 s; at
least 15 s), samples once more ("idle") and prints a markdown summary and the targets:
  - memory flat: over the last two thirds of the run, the level of RssAnon (the median sample
    of each window of a tenth of the run, at least 30 s) plus the rings' bytes (their median
    in the window, from GetStats every --stats-seconds) varies by at most 5% ((max - min) /
    min); single samples swing with the batches in flight and the allocator's free pages,
    which go back to the kernel within a second, while a leak moves the levels. The tier
    gives the rings the bytes they take (one budget), so RssAnon alone moves with the rings
    of the moment: its spread is printed too;
  - memory bound: each level within the memory budget - the rings' bytes (that window's
    median) + 64 MiB: the tier, the rings and the message path share the budget, the rings'
    pages are shared memory (RssShmem, not RssAnon), and 64 MiB is the issue's room for the
    rest (the runtime, the batches clients wait for beyond the message path's share, freed
    pages the allocator has not given back yet);
  - memory ceiling: at every sample the daemon's anonymous memory is within the ceiling it
    reports (anonymous_ceiling_bytes: memory budget + what the message path holds beyond its
    share + the allocator's free pages + 128 MiB, alloc::UNACCOUNTED_ALLOWANCE; a daemon that reports none fails);
  - descriptors: back to the count at the start (+- 4) once the clients stopped, counting one
    more for each scratch shard file made during the run (the daemon keeps its shards open);
  - exactly once: no completed epoch with a sample missing, repeated or holding wrong data;
  - clients: no errors (the killed and cancelled clients' ends excepted), none left hanging at
    the deadline, and the daemon still running at the end.
Exit status 1 when a target fails. benches/RESULTS.md's table is that of a 10-minute run.

The figures go to --out (see benches/results.py), whether the targets pass or not: soak.json
and soak.csv (the summary table's rows), soak-targets.csv (each target, PASS or not, and its
figures), soak-readings.csv (every /proc reading: time, RssAnon, VmRSS, RssShmem, descriptors,
threads) and soak-samples.csv (every GetStats sample: the daemon's accounts); the JSON holds
them all and the summary's figures as numbers. --plot draws the PNG: the daemon's memory over
the run (anonymous, resident, the rings, the memory tier) against the memory budget.
"""

import argparse
import contextlib
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import results

MiB = 1 << 20
N_IMAGES = 5000
IMAGE_SHAPE = (3, 64, 64)
N_CLIPS = 3000
MAX_CLIP = 4000
PICS_CLASSES = 4
PICS_PER_CLASS = 150
N_PICS = PICS_CLASSES * PICS_PER_CLASS
SIZES = {"h5": N_IMAGES, "h5gz": N_IMAGES, "clips": N_CLIPS, "pics": N_PICS}
# The memory budget the tier, the rings and the message path share (one account): the rings
# take at most half of it (97 MB), the message path a quarter (its default share), so the tier
# holds 48-145 MB of the 141 MB of data, by the rings of the moment.
MEMORY_BUDGET = 194_000_000
FLAT_LIMIT = 0.05
FD_SLACK = 4
# Pixels of the HDF5 images compared in eval epochs (flat indices into [3, 64, 64]).
PROBES = np.array([0, 1, 63, 4096, 4097 + 64 * 31, 12287])
# How long clients get after the deadline to stop by themselves, and how long the daemon gets
# to free its idle message buffers once they have.
STOP_GRACE = 20.0
IDLE_MIN, IDLE_MAX = 15.0, 40.0
STATS_FIELDS = [
    "anonymous_bytes", "anonymous_ceiling_bytes", "accounted_bytes", "memory_bytes", "shm_bytes",
    "message_buffer_spare_bytes", "message_buffer_in_flight_bytes", "allocator_free_bytes",
    "resident_bytes",
]


# ---------------------------------------------------------------------------------------------
# The data: every value a function of the sample id, so clients check batches without the files.


def image_values(ids: np.ndarray, flat: np.ndarray, gz: bool) -> np.ndarray:
    """uint8 pixels `flat` (flat indices into [3, 64, 64]) of HDF5 images `ids`."""
    a, b = (17, 3) if gz else (131, 7)
    return ((ids[:, None] * a + flat[None, :] * b) % 251).astype(np.uint8)


def clip_length(i: int) -> int:
    return (i * 2654435761) % (MAX_CLIP + 1)


def clip_values(i: int) -> np.ndarray:
    n = clip_length(i)
    return ((np.arange(n, dtype=np.int64) * 3 + i * 7) % 65536 - 32768).astype(np.int16)


def pics_label(i: np.ndarray) -> np.ndarray:
    # Class folders c0..c3 of PICS_PER_CLASS files each, served in sorted order.
    return i // PICS_PER_CLASS


def write_data(root: pathlib.Path) -> str:
    """Writes the four datasets under `root`; returns their part of the config."""
    import h5py
    from PIL import Image

    flat = np.arange(int(np.prod(IMAGE_SHAPE)))
    for name, gz in (("h5", False), ("h5gz", True)):
        path = root / f"{name}.h5"
        if path.exists():
            continue
        with h5py.File(path, "w") as f:
            kw = {"chunks": (64,) + IMAGE_SHAPE, "compression": "gzip"} if gz else {}
            images = f.create_dataset("images", (N_IMAGES,) + IMAGE_SHAPE, dtype=np.uint8, **kw)
            for s in range(0, N_IMAGES, 500):
                ids = np.arange(s, min(s + 500, N_IMAGES))
                images[s : s + len(ids)] = image_values(ids, flat, gz).reshape((len(ids),) + IMAGE_SHAPE)
            f.create_dataset("labels", data=np.arange(N_IMAGES, dtype=np.int64))
    path = root / "clips.h5"
    if not path.exists():
        with h5py.File(path, "w") as f:
            clips = f.create_dataset("clip", (N_CLIPS,), dtype=h5py.vlen_dtype(np.int16))
            for i in range(N_CLIPS):
                clips[i] = clip_values(i)
            f.create_dataset("labels", data=np.arange(N_CLIPS, dtype=np.int64) * 3)
    pics = root / "pics"
    if not pics.exists():
        rng = np.random.default_rng(0)
        tmp = root / "pics.partial"
        for c in range(PICS_CLASSES):
            (tmp / f"c{c}").mkdir(parents=True, exist_ok=True)
            for k in range(PICS_PER_CLASS):
                w = int(rng.integers(200, 501))
                h = int(w * 0.75) if rng.random() < 0.7 else int(rng.integers(150, 376))
                y, x = np.mgrid[0:h, 0:w]
                grad = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h) + 40 * c], -1)
                noise = rng.integers(0, 64, (h, w, 3))
                img = np.clip(grad + noise, 0, 255).astype(np.uint8)
                Image.fromarray(img).save(tmp / f"c{c}" / f"{k:04d}.jpg", quality=85)
        tmp.rename(pics)
    return (
        f'[[dataset]]\nname = "h5"\ntcp = true\npath = "{root / "h5.h5"}"\nsamples = "images"\nlabels = "labels"\n'
        "[dataset.train]\npadding = 4\n"
        f'[[dataset]]\nname = "h5gz"\ntcp = true\npath = "{root / "h5gz.h5"}"\nsamples = "images"\nlabels = "labels"\n'
        "[dataset.train]\npadding = 4\n"
        f'[[dataset]]\nname = "clips"\ntcp = true\npath = "{root / "clips.h5"}"\n'
        '[[dataset.field]]\nname = "clip"\n[[dataset.field]]\nname = "label"\nhdf5 = "labels"\n'
        f'[[dataset]]\nname = "pics"\ntcp = true\nkind = "images"\npath = "{pics}"\nresize = 96\ncrop = 64\n'
        "[dataset.train]\n"
    )


# ---------------------------------------------------------------------------------------------
# Clients (--client KIND): JSON lines on stdout, one per event.


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class _Report(logging.Handler):
    """The client library's warnings (e.g. a stream interrupted and resumed) as events."""

    def emit(self, record):
        emit(event="warning", msg=record.getMessage())


def check_batch(b, dataset: str, pipeline: str, layout: str):
    """Why batch `b` holds wrong data, or None."""
    ids = b.sample_ids
    if dataset in ("h5", "h5gz", "pics"):
        labels = np.asarray(b["label"])
        want = pics_label(ids) if dataset == "pics" else ids
        if labels.shape != ids.shape or not np.array_equal(labels, want):
            return f"labels are not the samples' (ids {ids[:4].tolist()}..., labels {labels[:4].tolist()}...)"
        image = b["image"]
        if image.shape[1:] != IMAGE_SHAPE:
            return f"image shape {image.shape}"
        if dataset != "pics" and pipeline == "eval":
            got = np.asarray(image).reshape(len(ids), -1)[:, PROBES]
            if not np.array_equal(got, image_values(ids, PROBES, dataset == "h5gz")):
                bad = int(np.nonzero((got != image_values(ids, PROBES, dataset == "h5gz")).any(1))[0][0])
                return f"pixels of sample {int(ids[bad])} are not its own"
        return None
    # clips
    if not np.array_equal(np.asarray(b["label"]), ids * 3):
        return "clip labels are not the samples'"
    clip = b["clip"]
    lengths = b.lengths["clip"][:, 0]
    for k, i in enumerate(ids.tolist()):
        want = clip_values(i)
        if lengths[k] != len(want):
            return f"clip {i}: length {int(lengths[k])}, want {len(want)}"
        if layout == "offsets":
            got = clip[k]
        else:
            row = clip[k]
            got = row[: len(want)]
            if row[len(want):].any():
                return f"clip {i}: padding is not zeros"
        if not np.array_equal(got, want):
            return f"clip {i}: values differ"
    return None


def client_main(args) -> int:
    import larder

    logging.getLogger("larder").addHandler(_Report())
    logging.getLogger("larder").setLevel(logging.WARNING)
    kind = args.client
    rng = np.random.default_rng(args.seed)
    address = f"unix:{args.socket}"
    deadline = args.deadline
    client = larder.Client(address)
    stream_no = 0
    # Each choice is dealt from a shuffled deck, dealt again once used up: every client goes
    # through all of its mix every few streams, so each window of the run sees the same mix
    # (independent draws made one minute's mix differ from the next's by about as much as the
    # flatness target, whatever the daemon did).
    decks = {}

    def deal(name: str, cards: list):
        deck = decks.setdefault(name, [])
        if not deck:
            deck.extend(rng.permutation(len(cards)).tolist())
        return cards[deck.pop()]

    strata = [(lo, lo + 64) for lo in range(1, 513, 64)]  # batch sizes 1..512 in 8 strata
    try:
        while time.time() < deadline:
            stream_no += 1
            # Each stream its own seed and epoch: no two streams of the run ask for one order.
            seed, epoch = args.seed * 1000 + stream_no, stream_no
            lo, hi = deal("batch", strata)
            batch = int(rng.integers(lo, hi))
            pipeline, layout = "eval", "padded"
            if kind in ("shm", "bytes", "victim"):
                dataset, pipeline = deal("what", [(d, p) for d in ("h5", "h5gz", "pics") for p in ("eval", "train")])
                transport = kind if kind != "victim" else str(rng.choice(["shm", "bytes"]))
            elif kind == "clips":
                dataset, transport = "clips", "bytes"
                layout = "offsets" if stream_no % 2 else "padded"
            else:  # cancel
                # A quarter of them on clips, as each dataset (6 of 24 cards).
                dataset, transport, pipeline = deal("what", [
                    (d, t, p) for d in ("h5", "h5gz", "pics") for t in ("auto", "shm", "bytes") for p in ("eval", "train")
                ] + [("clips", t, "eval") for t in ("auto", "bytes")] * 3)
            what = dict(kind=kind, dataset=dataset, transport=transport, batch=batch,
                        pipeline=pipeline, layout=layout, seed=seed, epoch=epoch)
            started = time.monotonic()
            stream = client.stream(dataset, batch, transport=transport, seed=seed, epoch=epoch,
                                   pipeline=pipeline, variable_layout=layout)
            ids, wrong, taken, stop_after, cut = [], None, 0, int(rng.integers(1, 4)), False
            try:
                for b in stream:
                    taken += 1
                    if wrong is None:
                        wrong = check_batch(b, dataset, pipeline, layout)
                    ids.append(b.sample_ids.copy())
                    del b
                    if kind == "cancel" and taken >= stop_after:
                        break
                    if time.time() >= deadline:
                        cut = True
                        break
            except larder.LarderError as e:
                # A ring the memory budget has no room for is refused (the daemon keeping its
                # budget: rings count in it, at most half of it); the stream asked for
                # transport="shm", so it has no fallback. An answer, not a failure.
                refused = "RESOURCE_EXHAUSTED" in str(e.code) and "ring" in str(e)
                emit(event="refused" if refused else "error", **what, batches=taken, code=str(e.code), msg=str(e))
                time.sleep(0.2)
                continue
            except Exception as e:  # noqa: BLE001 - reported, the soak goes on
                emit(event="error", **what, batches=taken, code=type(e).__name__, msg=repr(e))
                time.sleep(0.2)
                continue
            finally:
                stream.close()
            seconds = time.monotonic() - started
            got = np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
            if kind == "cancel":
                emit(event="cancelled", **what, batches=taken, seconds=seconds)
            elif cut and len(got) < SIZES[dataset]:
                emit(event="abandoned", **what, batches=taken, seconds=seconds)
            else:
                exact = len(got) == SIZES[dataset] and bool(np.array_equal(got, np.arange(SIZES[dataset])))
                if not exact and wrong is None:
                    missing = np.setdiff1d(np.arange(SIZES[dataset]), got).size
                    wrong = f"{len(got)} samples, {missing} missing, {len(got) - np.unique(got).size} repeated"
                emit(event="epoch", **what, batches=taken, seconds=seconds,
                     exact=exact and wrong is None, reason=wrong)
            if rng.random() < 0.2:  # a new client now and then: new channel, new rings
                client.close()
                client = larder.Client(address)
    finally:
        client.close()
    emit(event="done", streams=stream_no)
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: the daemon, the clients, the samples, the summary.


def proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
            elif key == "Threads":
                out[key] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


class Clients:
    """The client processes and what they reported."""

    def __init__(self, here: pathlib.Path, socket: pathlib.Path, root: pathlib.Path, deadline: float):
        self.here, self.socket, self.root, self.deadline = here, socket, root, deadline
        self.lock = threading.Lock()
        self.events = []
        self.procs = []  # (kind, Popen, reader thread)
        self.seeds = 0
        self.logs = {}

    def spawn(self, kind: str) -> subprocess.Popen:
        self.seeds += 1
        log = self.logs.get(kind)
        if log is None:
            log = self.logs[kind] = open(self.root / f"client-{kind}.log", "ab")
        p = subprocess.Popen(
            [sys.executable, str(self.here), "--client", kind, "--socket", str(self.socket),
             "--deadline", repr(self.deadline), "--seed", str(self.seeds)],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
        t = threading.Thread(target=self._read, args=(kind, p), daemon=True)
        t.start()
        self.procs.append((kind, p, t))
        return p

    def _read(self, kind: str, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                e = {"event": "garbage", "msg": line.strip()}
            e["proc"] = kind
            with self.lock:
                self.events.append(e)

    def stop(self, kinds, timeout: float) -> list:
        """Waits up to `timeout` s for the clients of `kinds` to exit, then SIGTERMs and
        SIGKILLs the rest; returns the kinds of those that had to be stopped."""
        end = time.monotonic() + timeout
        hung = []
        for kind, p, _ in self.procs:
            if kind not in kinds or p.poll() is not None:
                continue
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(kind)
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        return hung

    def kill_all(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.kill()
        for _, p, t in self.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=10)
            t.join(timeout=2)
        for log in self.logs.values():
            log.close()


def mib(n) -> str:
    return "n/a" if n is None else f"{n / MiB:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", "target/release/larderd"))
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--sample-seconds", type=float, default=0.5,
                   help="how often the daemon's /proc status is read (the memory levels)")
    p.add_argument("--stats-seconds", type=float, default=1,
                   help="how often the daemon's GetStats is asked too, and a line printed")
    p.add_argument("--dir", help="where the data, config, scratch and logs go (default: a temporary folder)")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    results.add_options(p)
    args = p.parse_args()
    if args.client:
        return client_main(args)
    if args.dir:
        root = pathlib.Path(args.dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        return soak(args, root)
    with tempfile.TemporaryDirectory(prefix="larder-soak-") as d:
        return soak(args, pathlib.Path(d))


def soak(args, root: pathlib.Path) -> int:
    import grpc

    from larder.v1 import larder_pb2 as pb
    from larder.v1.larder_pb2_grpc import LarderStub

    t = time.monotonic()
    datasets = write_data(root)
    print(f"data written in {time.monotonic() - t:.1f} s under {root}", flush=True)
    sock = root / "larder.sock"
    scratch = root / "scratch"
    if sock.exists():
        sock.unlink()
    config = root / "larder.toml"
    config.write_text(
        f'unix_socket = "{sock}"\n[scratch]\ndir = "{scratch}"\n'
        f"[memory]\nbudget_bytes = {MEMORY_BUDGET}\n" + datasets
    )
    daemon_log = open(root / "larderd.log", "ab")
    daemon = subprocess.Popen([args.larderd, "--config", str(config)], stderr=daemon_log)
    clients = None
    channel = None
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                print(f"larderd did not start; see {root / 'larderd.log'}")
                return 1
            time.sleep(0.05)
        channel = grpc.insecure_channel(f"unix:{sock}", options=[("grpc.default_authority", "localhost")])
        stub = LarderStub(channel)
        for info in stub.ListDatasets(pb.ListDatasetsRequest(), timeout=30).datasets:
            if info.num_samples != SIZES.get(info.name):
                print(f"dataset {info.name}: {info.num_samples} samples, expected {SIZES.get(info.name)}")
                return 1

        def shards() -> int:
            return sum(1 for _ in scratch.rglob("shard-*.bin")) if scratch.exists() else 0

        samples = []
        # Every reading of the daemon's /proc status while the clients run: the memory levels.
        readings = []

        def read_proc(t0: float) -> None:
            s = {"t": time.monotonic() - t0}
            try:
                s.update(proc_status(daemon.pid))
            except OSError:
                return  # the daemon just died: the loop says so
            if "RssAnon" in s:  # a zombie's status has none
                readings.append(s)

        def sample(phase: str, t0: float) -> dict:
            s = {"t": time.monotonic() - t0, "phase": phase}
            s.update(proc_status(daemon.pid))
            try:
                st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
                for f in STATS_FIELDS:
                    s[f] = getattr(st, f, 0)
                s["streams"] = st.active_streams
                s["served"] = st.bytes_served
            except grpc.RpcError as e:
                s["stats_error"] = f"{e.code()}: {e.details()}"
                for f in STATS_FIELDS:
                    s[f] = 0
                s["streams"] = -1
                s["served"] = samples[-1]["served"] if samples else 0
            rate = (s["served"] - samples[-1]["served"]) / max(s["t"] - samples[-1]["t"], 1e-3) if samples else 0
            samples.append(s)
            print(
                f"{s['t']:7.1f} {phase:>7} {mib(s['RssAnon']):>8} {mib(s['VmRSS']):>8} "
                f"{mib(s['RssShmem']):>8} {s['fds']:>5} {s['Threads']:>4} | "
                + " ".join(f"{mib(s[f]) if s[f] else '-':>8}" for f in STATS_FIELDS)
                + f" {s['streams']:>4} {rate / 1e6:>6.0f}" + (f"  stats: {s['stats_error']}" if "stats_error" in s else ""),
                flush=True,
            )
            return s

        minutes = args.minutes
        print(
            f"larderd pid {daemon.pid}, {minutes:g} min: 2 shm clients, bytes, clips, cancel, victim "
            f"(SIGKILLed after 1-4 s, again and again); memory budget {MEMORY_BUDGET / 1e6:g} MB\n"
            "MiB; anon/rss/shmem: /proc/PID/status RssAnon/VmRSS/RssShmem; the rest the daemon's "
            "GetStats (- where 0 or absent): s.anon anonymous_bytes, ceiling anonymous_ceiling_bytes,\n"
            "account accounted_bytes, memory memory_bytes, rings shm_bytes, spare/inflight message_buffer_"
            "spare/in_flight_bytes, free allocator_free_bytes, resident resident_bytes, strm active_streams, MB/s bytes_served per s",
            flush=True,
        )
        print(f"{'t(s)':>7} {'phase':>7} {'anon':>8} {'rss':>8} {'shmem':>8} {'fds':>5} {'thr':>4} | "
              + " ".join(f"{h:>8}" for h in ["s.anon", "ceiling", "account", "memory", "rings",
                                              "spare", "inflight", "free", "resident"])
              + f" {'strm':>4} {'MB/s':>6}", flush=True)
        t0 = time.monotonic()
        start = sample("start", t0)
        shards_start = shards()
        run_seconds = minutes * 60
        wall_deadline = time.time() + run_seconds
        end_at = t0 + run_seconds
        clients = Clients(pathlib.Path(__file__).resolve(), sock, root, wall_deadline)
        steady = ["shm", "shm", "bytes", "clips", "cancel"]
        for kind in steady:
            clients.spawn(kind)
        rng = np.random.default_rng(1)
        victim = clients.spawn("victim")
        kill_at = time.monotonic() + rng.uniform(1, 4)
        kills = 0
        next_sample = t0 + args.stats_seconds
        next_reading = t0 + args.sample_seconds
        daemon_died = None
        while time.monotonic() < end_at:
            now = time.monotonic()
            if daemon.poll() is not None:
                daemon_died = daemon.returncode
                print(f"larderd exited with {daemon_died} during the run")
                break
            if now >= kill_at:
                if victim.poll() is None:
                    victim.kill()
                    kills += 1
                victim.wait()
                victim = clients.spawn("victim")
                kill_at = now + rng.uniform(1, 4)
            if now >= next_reading:
                read_proc(t0)
                next_reading += args.sample_seconds
            if now >= next_sample:
                sample("run", t0)
                next_sample += args.stats_seconds
            time.sleep(max(0.0, min(0.05, end_at - time.monotonic())))
        if victim.poll() is None:
            victim.kill()
            kills += 1
        victim.wait()
        end = sample("run", t0) if daemon_died is None else None
        hung = clients.stop(set(steady), STOP_GRACE)
        for kind in hung:
            print(f"a {kind} client did not stop within {STOP_GRACE:.0f} s of the deadline: stopped it")

        # Idle: the daemon frees spare message buffers unused for 10 s.
        idle = None
        if daemon_died is None and daemon.poll() is None:
            stopped = time.monotonic()
            while time.monotonic() - stopped < IDLE_MAX:
                time.sleep(1)
                if time.monotonic() - stopped < IDLE_MIN:
                    continue
                try:
                    st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
                except grpc.RpcError:
                    break
                if not (st.message_buffer_spare_bytes or st.message_buffer_in_flight_bytes or st.active_streams):
                    break
            idle = sample("idle", t0)
        shards_end = shards()

        with clients.lock:
            events = list(clients.events)
        return summarize(args, samples, readings, start, end, idle, events, kills, hung, daemon,
                         daemon_died, shards_end - shards_start, root)
    finally:
        if clients is not None:
            clients.kill_all()
        if channel is not None:
            channel.close()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                print("larderd did not exit within 20 s of SIGTERM; killed it")
                daemon.kill()
                daemon.wait()
        daemon_log.close()


def summarize(args, samples, readings, start, end, idle, events, kills, hung, daemon, daemon_died,
              new_shards, root) -> int:
    run = [s for s in samples if s["phase"] == "run"]
    run_seconds = args.minutes * 60
    later = [s for s in run if s["t"] >= run_seconds / 3]
    warm = later[0] if later else None

    def count(kind=None, event="epoch", **match):
        return sum(1 for e in events if e["event"] == event and (kind is None or e["proc"] == kind)
                   and all(e.get(k) == v for k, v in match.items()))

    epochs = [e for e in events if e["event"] == "epoch"]
    wrong = [e for e in epochs if not e["exact"]]
    errors = [e for e in events if e["event"] in ("error", "garbage")]
    warnings = [e for e in events if e["event"] == "warning"]
    # The victim's errors can only be from before its kill (it is killed mid-stream, reporting
    # nothing then); none is expected from any client.
    per_dataset = ", ".join(f"{d} {sum(1 for e in epochs if e['dataset'] == d)}" for d in SIZES)
    anon = [r["RssAnon"] for r in readings if r["t"] >= run_seconds / 3]
    raw_lo, raw_hi = (min(anon), max(anon)) if anon else (0, 0)
    # The level of each window of a tenth of the run (at least 30 s): its median reading (one
    # every --sample-seconds). Single readings swing with the batches in flight and the
    # allocator's free pages, which go back to the kernel within a second; a leak moves the
    # levels. (A reading every 5 s left the median of a minute's 12 readings about 3% off its
    # window's level, as much as the target's room.)
    window = max(30.0, run_seconds / 10)
    levels = {}
    for s in (r for r in readings if r["t"] >= run_seconds / 3):
        levels.setdefault(int((s["t"] - run_seconds / 3) // window), []).append(s["RssAnon"])
    medians = [sorted(v)[len(v) // 2] for _, v in sorted(levels.items())]
    # The bound on each level (the tier's budget + the rings + 64 MiB, with the tier's
    # budget what the rings leave of the one budget): the memory budget - the rings' bytes
    # (their median in that window; shared memory, not in RssAnon) + 64 MiB.
    rings_by_window = {}
    for s in later:
        if "stats_error" not in s:
            rings_by_window.setdefault(int((s["t"] - run_seconds / 3) // window), []).append(s["shm_bytes"])
    ring_medians = [sorted(rings_by_window.get(k, [0]))[len(rings_by_window.get(k, [0])) // 2]
                    for k, _ in sorted(levels.items())]
    bounds = [MEMORY_BUDGET - r + 64 * MiB for r in ring_medians]
    margins = [b - m for b, m in zip(bounds, medians)]
    # Flat: what the daemon holds of the budget, its anonymous memory and its rings together.
    # The tier gives the rings the bytes they take (one budget), so anonymous memory alone
    # moves with the rings of the moment (reported too), while a leak moves both.
    totals = [m + r for m, r in zip(medians, ring_medians)]
    lo, hi = (min(totals), max(totals)) if totals else (0, 0)
    spread = (hi - lo) / lo if lo else float("inf")
    alo, ahi = (min(medians), max(medians)) if medians else (0, 0)
    anon_spread = (ahi - alo) / alo if alo else float("inf")
    every = [s for s in samples if s["phase"] != "start"] + [start]
    ceilings = [s["anonymous_ceiling_bytes"] for s in every]
    has_ceiling = all(ceilings)
    over = [s for s in every if s["anonymous_ceiling_bytes"] and
            (s["anonymous_bytes"] or s["RssAnon"]) > s["anonymous_ceiling_bytes"]]
    fd_end = idle["fds"] if idle else None
    fd_ok = fd_end is not None and abs(fd_end - start["fds"] - new_shards) <= FD_SLACK
    threads = [s["Threads"] for s in samples]

    def beyond(s):
        # What the kernel counts as the daemon's heap beyond what it accounts for there.
        return (s["RssAnon"] - s["memory_bytes"] - s["message_buffer_spare_bytes"]
                - s["message_buffer_in_flight_bytes"] - s["allocator_free_bytes"])

    targets = [
        ("anonymous memory + rings flat over the last two thirds (<= 5%)", len(totals) >= 2 and spread <= FLAT_LIMIT,
         f"levels {mib(lo)}-{mib(hi)} MiB, {spread * 100:.1f}% over {len(totals)} windows of {window:.0f} s "
         f"(anonymous alone {mib(alo)}-{mib(ahi)} MiB, {anon_spread * 100:.1f}%; samples {mib(raw_lo)}-{mib(raw_hi)} MiB)"),
        ("anonymous memory level within the budget - rings + 64 MiB", bool(margins) and min(margins) >= 0,
         f"margins {mib(min(margins)) if margins else 'n/a'} to {mib(max(margins)) if margins else 'n/a'} MiB "
         f"over {len(margins)} windows (bounds {mib(min(bounds)) if bounds else 'n/a'}-{mib(max(bounds)) if bounds else 'n/a'} MiB)"),
        ("anonymous memory within the daemon's ceiling", has_ceiling and not over,
         ("the daemon reports no ceiling" if not has_ceiling else
          f"max {mib(max((s['anonymous_bytes'] or s['RssAnon']) for s in every))} MiB; ceiling "
          f"{mib(min(ceilings))}-{mib(max(ceilings))} MiB; {len(over)} samples over")),
        (f"descriptors back to the start (+-{FD_SLACK}, + scratch shards made)", fd_ok,
         f"{start['fds']} -> {fd_end if fd_end is not None else 'n/a'} ({new_shards} shard files made)"),
        ("every completed epoch exactly once, data its samples'", not wrong and len(epochs) > 0,
         f"{len(epochs)} epochs, {len(wrong)} wrong"),
        ("no client errors, no hung client, daemon up", not errors and not hung and daemon_died is None
         and idle is not None, f"{len(errors)} errors, {len(hung)} hung"
         + (f", daemon exited {daemon_died}" if daemon_died is not None else "")),
    ]

    print()
    print(f"## Soak: {args.minutes:g} min, 6 client processes, memory budget {MEMORY_BUDGET / 1e6:g} MB")
    print()
    print("| | |")
    print("|---|---|")
    rows = [
        ("clients", "2 shm, 1 bytes, 1 clips (variable length), 1 cancel, 1 victim slot (SIGKILLed)"),
        ("shm: epochs (streams)", f"{count('shm')} ({count('shm') + count('shm', 'abandoned') + count('shm', 'error')})"),
        ("bytes: epochs (streams)", f"{count('bytes')} ({count('bytes') + count('bytes', 'abandoned') + count('bytes', 'error')})"),
        ("clips: epochs padded / offsets", f"{count('clips', layout='padded')} / {count('clips', layout='offsets')}"),
        ("cancel: streams dropped after 1-3 batches", f"{count('cancel', 'cancelled')}"),
        ("victim: clients SIGKILLed / epochs they completed", f"{kills} / {count('victim')}"),
        ("epochs per dataset", per_dataset),
        ("wrong epochs", f"{len(wrong)}"),
        ("client errors / warnings", f"{len(errors)} / {len(warnings)}"),
        ("shm streams refused a ring (over the memory budget's half)", str(count(event="refused"))),
        ("anonymous MiB: start / after warm-up / max / end / idle",
         " / ".join([mib(start["RssAnon"]), mib(warm["RssAnon"]) if warm else "n/a",
                     mib(max(s["RssAnon"] for s in samples)), mib(end["RssAnon"]) if end else "n/a",
                     mib(idle["RssAnon"]) if idle else "n/a"])),
        ("anonymous + rings, last two thirds: levels per window (spread); anonymous alone; samples", f"{mib(lo)}-{mib(hi)} MiB ({spread * 100:.1f}%); {mib(alo)}-{mib(ahi)} MiB ({anon_spread * 100:.1f}%); {mib(raw_lo)}-{mib(raw_hi)} MiB"),
        ("anonymous beyond the memory tier and message buffers: max / idle",
         f"{mib(max(map(beyond, samples)))} / {mib(beyond(idle)) if idle else 'n/a'} MiB"),
        ("ceiling reported by the daemon", f"{mib(min(ceilings))}-{mib(max(ceilings))} MiB" if has_ceiling else "n/a"),
        ("idle: accounted / spare / in flight MiB",
         " / ".join(mib(idle[f]) for f in ("accounted_bytes", "message_buffer_spare_bytes",
                                            "message_buffer_in_flight_bytes")) if idle else "n/a"),
        ("resident MiB: max / idle (shared: max)",
         f"{mib(max(s['VmRSS'] for s in samples))} / {mib(idle['VmRSS']) if idle else 'n/a'} "
         f"({mib(max(s['RssShmem'] for s in samples))})"),
        ("descriptors start / end (idle)", f"{start['fds']} / {fd_end if fd_end is not None else 'n/a'}"
         f" ({new_shards} scratch shard files made)"),
        ("threads start / max / end (idle)", f"{start['Threads']} / {max(threads)} / {idle['Threads'] if idle else 'n/a'}"),
    ]
    for k, v in rows:
        print(f"| {k} | {v} |")
    print()
    print("| target | result | |")
    print("|---|---|---|")
    for name, ok, detail in targets:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |")
    for e in wrong[:10]:
        print(f"wrong epoch: {json.dumps(e)}")
    for e in errors[:10]:
        print(f"client error: {json.dumps(e)}")
    for e in warnings[:5]:
        print(f"client warning: {json.dumps(e)}")
    log = root / "larderd.log"
    if log.exists():
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in log.read_text(errors="replace").splitlines()]
        bad = [ln for ln in lines if " ERROR " in ln or "panicked" in ln]
        warned = [ln for ln in lines if " WARN " in ln]
        print(f"larderd log: {len(lines)} lines, {len(bad)} errors, {len(warned)} warnings")
        for ln in (bad + warned)[:10]:
            print(f"  {ln[:300]}")
    failed = [name for name, ok, _ in targets if not ok]
    results.save(
        "soak", args, [{"item": k, "value": v} for k, v in rows],
        tables={"targets": [{"target": name, "pass": ok, "detail": detail} for name, ok, detail in targets],
                "readings": readings, "samples": samples},
        memory_budget_bytes=MEMORY_BUDGET, passed=not failed,
        figures={
            "epochs": len(epochs), "wrong_epochs": len(wrong), "client_errors": len(errors),
            "client_warnings": len(warnings), "clients_killed": kills, "hung_clients": hung,
            "cancelled_streams": count("cancel", "cancelled"), "refused_rings": count(event="refused"),
            "epochs_per_dataset": {d: sum(1 for e in epochs if e["dataset"] == d) for d in SIZES},
            "window_seconds": window, "levels_anonymous_bytes": medians, "levels_rings_bytes": ring_medians,
            "levels_bound_bytes": bounds, "level_margins_bytes": margins,
            "anonymous_plus_rings_spread": spread if totals else None,
            "anonymous_spread": anon_spread if medians else None,
            "anonymous_start_bytes": start["RssAnon"], "anonymous_after_warmup_bytes": warm["RssAnon"] if warm else None,
            "anonymous_max_bytes": max(s["RssAnon"] for s in samples),
            "anonymous_end_bytes": end["RssAnon"] if end else None,
            "anonymous_idle_bytes": idle["RssAnon"] if idle else None,
            "ceiling_bytes": [min(ceilings), max(ceilings)] if has_ceiling else None,
            "samples_over_ceiling": len(over),
            "descriptors_start": start["fds"], "descriptors_idle": fd_end, "scratch_shards_made": new_shards,
            "threads_start": start["Threads"], "threads_max": max(threads),
            "threads_idle": idle["Threads"] if idle else None,
        })
    if failed:
        print("FAIL: " + "; ".join(failed))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
