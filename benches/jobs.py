"""The memory tier's hit rate with concurrent training jobs, next to Belady's optimum.

Belady's offline optimum is computed on the lookups of the same run, as the daemon recorded them.

    PYTHONPATH=python .venv/bin/python benches/jobs.py [--larderd target/release/larderd]
        [--samples 5000] [--epochs 4] [--configs 1x50,1x25,2x50,2x25,4x50,4x25,3x35s,4x25s]
        [--policies stale_lru,next_use] [--out benches/results] [--plot] [--json out.json]
        [--dir DIR] [--keep]
    PYTHONPATH=python .venv/bin/python benches/jobs.py --selftest   (no daemon: checks Belady)
    PYTHONPATH=python .venv/bin/python benches/jobs.py --samples 300 --epochs 2 --configs 1x50,2x25s   (smoke)

It writes one HDF5 file (uint8 `images` [N, 3, 64, 64], N = --samples, and int64 `labels` [N],
label i for sample i), then, for each configuration KxPP (K jobs, a memory tier holding PP% of
the samples; a trailing "s": every job the same seed; a trailing "c": correlated orders, each
job its own seed over one cohort's base order, reshuffled within windows of 2% of the samples)
and each eviction policy of --policies
(`[memory] policy`), starts a fresh larderd with:
  - the scratch tier off (`[scratch] enabled = false`): every memory miss is a raw read;
  - a memory budget of floor(PP% * N) entries: budget_bytes = floor(PP% * N) * the bytes one
    entry is charged (its record and 192 bytes of bookkeeping), which a probe daemon measures
    first (one batch streamed, then GetStats memory_bytes / memory_entries), plus the message
    path's share (`message_bytes`, MESSAGE_BYTES: the batches on their way to the jobs), which
    the daemon holds back from the tier;
  - `min_available_bytes = 0`, so the tier's limit stays at its budget whatever the machine's
    free memory (the run measures the policy, not the watcher);
  - LARDER_TRACE=PATH: the daemon appends one 16-byte little-endian record per memory-tier
    lookup (u32 dataset id, u32 outcome: 0 miss, fetched from a lower tier; 1 memory hit; 2
    joined a fetch of the sample already in flight; u64 sample index), flushed when it exits
    on SIGTERM, which it gets once the jobs are done.
The K jobs are processes of their own (this file with --job), started together once each has
connected: each streams --epochs epochs one after another (epoch 0, 1, ...), batch size 50,
shuffled, seed 1000 + j for job j ("distinct") or 42 for all ("one seed"), in the messages
(transport="bytes": shared-memory rings would take their bytes from the tier's budget); every epoch of every job is checked: its sample ids, sorted, are exactly 0..N-1 and each
label is its sample's (the bench fails otherwise).

From the trace of each run: lookups; larder hits, the lookups served without a lower-tier
read (outcomes 1 and 2; "joined" gives the share of 2); lower-tier reads (outcome 0). On the same
key sequence, Belady's MIN with bypass for a tier of the same number of entries (every sample
the same size): a hit when the sample is held; on a miss the newcomer is not admitted if its
next use is later than that of every held entry, else the held entry used farthest in the
future makes room. That is the most hits any policy could have had on that sequence (in a
later run the interleaving differs a little). The first lookup of each sample is a miss for
both. The table gives both hit rates, the gap in points (Belady - larder), the lower-tier reads
over Belady's misses (1.00: optimal), and the samples/s of all jobs together (all samples over
the time from the first job's start to the last one's end). A join lets larder serve a second
request for a sample it is still fetching whether or not the tier then keeps it, which Belady,
counting whole lookups, cannot do: a gap slightly below zero is possible, not a bug.

The figures go to --out (see benches/results.py): jobs.json and jobs.csv, a row per run (its
configuration, policy and every figure of the table), with each run's raw counts, stats and
per-epoch times under `runs` in the JSON; --json PATH writes that JSON to PATH instead (its CSV
beside it). --plot draws the PNG: each configuration's hits per policy, Belady's as a mark.

--selftest checks the Belady implementation against a straightforward one on 200 random traces
and against an exhaustive search over every admission and eviction choice on smaller ones.
"""

import argparse
import functools
import heapq
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

import results

SHAPE = (3, 64, 64)
BATCH = 50
# What the memory tier charges per entry on top of the sample's record (src/tiers/memory.rs,
# ENTRY_OVERHEAD).
ENTRY_OVERHEAD = 192
# LARDER_TRACE's records.
TRACE_DTYPE = np.dtype([("dataset", "<u4"), ("outcome", "<u4"), ("index", "<u8")])
MISS, HIT, JOINED = 0, 1, 2
DISTINCT_SEED, ONE_SEED = 1000, 42
DEFAULT_CONFIGS = "1x50,1x25,2x50,2x25,4x50,4x25,3x35s,4x25s"
# How the jobs of a configuration are seeded, by its suffix.
SEEDS = {"": "distinct", "s": "one seed", "c": "correlated (windows of 2%)", False: "distinct", True: "one seed"}
HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parent.parent


# ---------------------------------------------------------------------------------------------
# Belady's MIN with bypass.


# The message path's share of the memory budget, added to each run's budget (so the tier's
# own is the configuration's share of the samples).
MESSAGE_BYTES = 32 << 20

def next_uses(keys: np.ndarray) -> np.ndarray:
    """For each position i, the next position holding the same key, or len(keys) for none."""
    keys = np.asarray(keys)
    n = len(keys)
    nxt = np.full(n, n, dtype=np.int64)
    if n < 2:
        return nxt
    order = np.argsort(keys, kind="stable")  # grouped by key, positions ascending within
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(keys, capacity: int) -> int:
    """Hits of the optimal tier of `capacity` equal-sized entries on the sequence `keys`
    (hashable, or integers), admission optional: on a miss the newcomer comes in unless its
    next use is later than every held entry's; when full, the entry used farthest in the future
    goes. A max-heap of (next use, key) with stale pairs skipped: O(n log n)."""
    keys = np.asarray(keys)
    if capacity <= 0 or len(keys) == 0:
        return 0
    _, dense = np.unique(keys, return_inverse=True)
    dense = dense.reshape(-1).tolist()
    nxt = next_uses(np.asarray(dense)).tolist()
    held = {}  # key -> its next use
    heap = []  # (-next use, key); a pair is stale unless held[key] is that next use
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for k, nu in zip(dense, nxt):
        if k in held:
            hits += 1
            held[k] = nu
            push(heap, (-nu, k))
            continue
        if len(held) < capacity:
            held[k] = nu
            push(heap, (-nu, k))
            continue
        while True:
            far, v = heap[0]
            if held.get(v) == -far:
                break
            pop(heap)
        if -far > nu:
            pop(heap)
            del held[v]
            held[k] = nu
            push(heap, (-nu, k))
        # else: bypass, the newcomer is needed later than everything held
    return hits


def belady_brute(keys, capacity: int) -> int:
    """The same rule, the plain way: scans forward for every held entry's next use on each miss."""
    keys = list(keys)
    n = len(keys)

    def next_use(i, k):
        for j in range(i + 1, n):
            if keys[j] == k:
                return j
        return n

    held, hits = [], 0
    for i, k in enumerate(keys):
        if k in held:
            hits += 1
        elif capacity <= 0:
            continue
        elif len(held) < capacity:
            held.append(k)
        else:
            far = max(held, key=lambda h: next_use(i, h))
            if next_use(i, far) > next_use(i, k):
                held.remove(far)
                held.append(k)
    return hits


def optimum_exhaustive(keys, capacity: int) -> int:
    """The most hits of any tier of `capacity` entries that fetches on a miss and then keeps
    the newcomer (in place of any held entry, or in a free place) or not: every choice tried."""
    keys = tuple(keys)

    @functools.lru_cache(maxsize=None)
    def best(i: int, held: frozenset) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in held:
            return 1 + best(i + 1, held)
        options = [best(i + 1, held)]
        if capacity > 0:
            if len(held) < capacity:
                options.append(best(i + 1, held | {k}))
            else:
                options += [best(i + 1, (held - {v}) | {k}) for v in held]
        return max(options)

    return best(0, frozenset())


def selftest() -> int:
    rng = random.Random(7)
    for t in range(200):
        keys = [rng.randrange(10) for _ in range(60)]
        fast, brute = belady_hits(keys, 3), belady_brute(keys, 3)
        assert fast == brute, f"trace {t}: belady_hits {fast}, brute force {brute}: {keys}"
    for t in range(300):
        n, k, c = rng.randrange(1, 15), rng.randrange(1, 7), rng.randrange(0, 4)
        keys = [rng.randrange(k) for _ in range(n)]
        fast, best = belady_hits(keys, c), optimum_exhaustive(keys, c)
        assert fast == best, f"small trace {t} (capacity {c}): belady_hits {fast}, optimum {best}: {keys}"
    # Edges: nothing held, everything held, no lookups, keys far apart, several datasets.
    keys = [rng.randrange(50) for _ in range(500)]
    assert belady_hits(keys, 0) == 0
    assert belady_hits(keys, 50) == len(keys) - len(set(keys))
    assert belady_hits([], 3) == 0
    assert belady_hits([1 << 40, 5, 1 << 40, 5], 1) == 1
    # Shuffled epochs over N samples, capacity C: at best C hits per epoch after the first...
    # and MIN gets more (it keeps what comes soon); LRU would get about C * C / N.
    n, cap = 200, 50
    order = np.concatenate([np.random.default_rng(e).permutation(n) for e in range(4)])
    got = belady_hits(order, cap)
    assert got >= 3 * cap, got
    # A larger trace in well under a few seconds.
    big = np.concatenate([np.random.default_rng(e).permutation(5000) for e in range(40)])
    t = time.perf_counter()
    belady_hits(big, 1250)
    seconds = time.perf_counter() - t
    # The trace parser: records written as the daemon writes them.
    recs = np.zeros(3, TRACE_DTYPE)
    recs["dataset"], recs["outcome"], recs["index"] = [1, 1, 1], [MISS, HIT, JOINED], [7, 7, 1 << 33]
    with tempfile.NamedTemporaryFile(suffix=".trace") as f:
        f.write(b"".join(int(d).to_bytes(4, "little") + int(o).to_bytes(4, "little") + int(i).to_bytes(8, "little")
                         for d, o, i in zip(recs["dataset"], recs["outcome"], recs["index"])))
        f.flush()
        back = read_trace(pathlib.Path(f.name))
    assert np.array_equal(back, recs), back
    a = analyze(back, 1)
    assert (a["lookups"], a["hits"], a["joined"], a["lower_reads"], a["belady_hits"]) == (3, 2, 1, 1, 1), a
    print(f"selftest passed: 200 traces against the brute force, 300 against the exhaustive optimum; "
          f"{len(big):,} lookups in {seconds:.2f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# The trace.


def read_trace(path: pathlib.Path) -> np.ndarray:
    raw = path.read_bytes()
    if len(raw) % TRACE_DTYPE.itemsize:
        raise SystemExit(f"{path}: {len(raw)} bytes, not a whole number of {TRACE_DTYPE.itemsize}-byte records")
    return np.frombuffer(raw, TRACE_DTYPE)


def analyze(trace: np.ndarray, capacity: int) -> dict:
    """The run's counts from its trace, and Belady's on the same keys."""
    outcome = trace["outcome"]
    unknown = np.setdiff1d(np.unique(outcome), [MISS, HIT, JOINED])
    if unknown.size:
        raise SystemExit(f"the trace has outcomes {unknown.tolist()}: expected 0 (miss), 1 (hit), 2 (joined)")
    keys = (trace["dataset"].astype(np.uint64) << np.uint64(40)) | trace["index"]
    n = len(trace)
    hit, joined = int((outcome == HIT).sum()), int((outcome == JOINED).sum())
    best = belady_hits(keys, capacity)
    return {
        "lookups": n,
        "hits": hit + joined,
        "joined": joined,
        "lower_reads": n - hit - joined,
        "distinct_samples": int(np.unique(keys).size),
        "datasets": np.unique(trace["dataset"]).tolist(),
        "belady_hits": best,
        "belady_misses": n - best,
    }


# ---------------------------------------------------------------------------------------------
# A job (--job ADDRESS): JSON lines on stdout.


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def job_main(args) -> int:
    import larder

    n = args.samples
    want = np.arange(n, dtype=np.int64)
    with larder.Client(args.job) as client:
        client.dataset("d")  # connected, and the dataset is open
        emit(event="ready")
        if sys.stdin.readline().strip() != "go":
            return 1
        start = time.time()
        epoch_seconds = []
        for e in range(args.epochs):
            t = time.perf_counter()
            ids = []
            cohort = dict(cohort_seed=ONE_SEED, window=args.job_window) if args.job_window else {}
            for b in client.stream("d", args.batch, seed=args.job_seed, epoch=e, shuffle=True,
                                transport="bytes", **cohort):
                sid = b.sample_ids.copy()
                labels = np.asarray(b["label"]).reshape(-1)
                if not np.array_equal(labels, sid):
                    emit(event="error", epoch=e, msg=f"labels {labels[:4].tolist()}... are not those of "
                         f"samples {sid[:4].tolist()}...")
                    return 1
                int(np.asarray(b["image"]).reshape(-1)[0])  # as a training step's transfer would
                ids.append(sid)
                del b
            got = np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
            if not np.array_equal(got, want):
                missing = np.setdiff1d(want, got).size
                emit(event="error", epoch=e, msg=f"epoch {e}: {len(got)} samples, {missing} missing, "
                     f"{len(got) - np.unique(got).size} repeated, expected each of 0..{n - 1} once")
                return 1
            epoch_seconds.append(time.perf_counter() - t)
        emit(event="done", start=start, end=time.time(), samples=args.epochs * n, epoch_seconds=epoch_seconds)
    return 0


# ---------------------------------------------------------------------------------------------
# The parent.


def write_images(path: pathlib.Path, n: int) -> pathlib.Path:
    """n random uint8 images of SHAPE and int64 labels 0..n-1."""
    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("images", (n,) + SHAPE, dtype=np.uint8)
        for s in range(0, n, 1000):
            d[s : s + 1000] = rng.integers(0, 256, (min(1000, n - s),) + SHAPE, dtype=np.uint8)
        f["labels"] = np.arange(n, dtype=np.int64)
    return path


def config_text(root: pathlib.Path, tag: str, h5: pathlib.Path, budget: int, policy) -> str:
    text = (
        f'unix_socket = "{root / (tag + ".sock")}"\n'
        f'[scratch]\nenabled = false\ndir = "{root / "scratch"}"\n'
        f"[memory]\nbudget_bytes = {budget + MESSAGE_BYTES}\nmessage_bytes = {MESSAGE_BYTES}\n"
        "min_available_bytes = 0\n"
    )
    if policy:
        text += f'policy = "{policy}"\n'
    return text + f'[[dataset]]\nname = "d"\npath = "{h5}"\nlabels = "labels"\n'


def log_tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_daemon(args, root: pathlib.Path, tag: str, config: str, trace=None):
    """A fresh larderd with `config`; returns (process, address, log path) once it listens and
    its dataset has been tried."""
    (root / f"{tag}.toml").write_text(config)
    address_file = root / f"{tag}.address"
    address_file.unlink(missing_ok=True)
    (root / f"{tag}.sock").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "LARDER_TRACE"}
    if trace is not None:
        trace.unlink(missing_ok=True)  # the daemon appends
        env["LARDER_TRACE"] = str(trace)
    log = root / f"{tag}.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen(
            [args.larderd, "--config", str(root / f"{tag}.toml"), "--address-file", str(address_file)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    deadline = time.monotonic() + 60
    while not address_file.exists():
        if daemon.poll() is not None:
            raise SystemExit(f"larderd ({tag}) exited with {daemon.returncode} before listening; {log}:\n"
                             f"{log_tail(log)}")
        if time.monotonic() > deadline:
            daemon.kill()
            daemon.wait()
            raise SystemExit(f"larderd ({tag}) wrote no address within 60 s; {log}:\n{log_tail(log)}")
        time.sleep(0.05)
    return daemon, address_file.read_text().strip(), log


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (/proc/PID/stat)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_daemon(daemon: subprocess.Popen, tag: str, log: pathlib.Path) -> None:
    """SIGTERM, and a normal exit (which flushes the trace), or the bench fails."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            raise SystemExit(f"larderd ({tag}) did not exit within 60 s of SIGTERM (killed; its trace is "
                             f"incomplete); {log}:\n{log_tail(log)}") from None
    if daemon.returncode != 0:
        raise SystemExit(f"larderd ({tag}) exited with {daemon.returncode}; {log}:\n{log_tail(log)}")


def probe_entry_cost(args, root: pathlib.Path, h5: pathlib.Path) -> int:
    """The bytes the memory tier charges for one sample (its record + ENTRY_OVERHEAD), measured
    on a daemon of ample budget that has served a batch."""
    import larder

    budget = args.samples * (4 * int(np.prod(SHAPE)) + ENTRY_OVERHEAD)
    daemon, address, log = start_daemon(args, root, "probe", config_text(root, "probe", h5, budget, None))
    try:
        with larder.Client(address) as client:
            stream = client.stream("d", 10, seed=0, epoch=0, prefetch=0)
            for _ in stream:
                break
            stream.close()
            # Fetches the daemon started ahead of the client finish and land in the tier; the
            # count read is one where bytes and entries agree (one snapshot under the lock).
            deadline = time.monotonic() + 10
            while True:
                st = client.stats()
                if st.memory_entries >= 10 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    finally:
        stop_daemon(daemon, "probe", log)
    if st.memory_entries == 0:
        raise SystemExit("the probe daemon holds no sample after a batch: cannot measure an entry's cost")
    cost, rest = divmod(st.memory_bytes, st.memory_entries)
    if rest:
        raise SystemExit(f"the probe's entries differ in size ({st.memory_bytes} bytes for "
                         f"{st.memory_entries} entries): this bench assumes one size")
    return cost


def parse_configs(spec: str):
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        one_seed = "s" if item.endswith("s") else "c" if item.endswith("c") else ""
        jobs, _, pct = item.rstrip("sc").partition("x")
        try:
            out.append((int(jobs), int(pct) / 100, one_seed))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not KxPP or KxPPs (e.g. 2x50, 3x35s)") from None
        if out[-1][0] < 1 or not 0 <= out[-1][1] <= 1:
            raise SystemExit(f"--configs: {item!r}: at least one job and 0..100%")
    if not out:
        raise SystemExit("--configs: no configuration")
    return out


def run_jobs(args, root: pathlib.Path, tag: str, address: str, seeds, window: int = 0):
    """Runs one job process per seed, started together; returns their 'done' events."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "python"), env.get("PYTHONPATH")]))
    procs, logs = [], []
    try:
        for j, seed in enumerate(seeds):
            log = root / f"{tag}-job{j}.log"
            logs.append(log)
            with open(log, "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, str(HERE), "--job", address, "--job-seed", str(seed),
                     "--job-window", str(window),
                     "--samples", str(args.samples), "--epochs", str(args.epochs), "--batch", str(args.batch)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                ))

        def failed(j, what):
            return SystemExit(f"job {j} of {tag} {what}; {logs[j]}:\n{log_tail(logs[j])}")

        for j, p in enumerate(procs):
            line = p.stdout.readline()
            try:
                ready = json.loads(line)["event"] == "ready"
            except (ValueError, KeyError, TypeError):
                ready = False
            if not ready:
                raise failed(j, f"did not get ready (said {line.strip()!r})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.monotonic() + args.timeout
        done = []
        for j, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise failed(j, f"did not finish within --timeout {args.timeout:g} s") from None
            events = [json.loads(ln) for ln in out.splitlines() if ln.strip()]
            errors = [e for e in events if e.get("event") == "error"]
            if errors:
                raise failed(j, f"(seed {seeds[j]}) failed the exactly-once check: {errors[0]['msg']}")
            finished = [e for e in events if e.get("event") == "done"]
            if p.returncode != 0 or not finished:
                raise failed(j, f"exited with {p.returncode} without finishing")
            done.append(finished[0])
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_one(args, root, h5, entry_cost, jobs, share, one_seed, policy) -> dict:
    import larder

    capacity = int(share * args.samples)
    budget = capacity * entry_cost
    name = f"{jobs}x{round(share * 100)}{one_seed}"
    tag = f"{name}-{policy}"
    trace_path = root / f"{tag}.trace"
    daemon, address, log = start_daemon(args, root, tag, config_text(root, tag, h5, budget, policy), trace_path)
    try:
        seeds = [ONE_SEED] * jobs if one_seed == "s" else [DISTINCT_SEED + j for j in range(jobs)]
        window = max(1, args.samples // 50) if one_seed == "c" else 0
        perf = start_perf(args, root / f"{tag}.perf", daemon.pid)
        try:
            done = run_jobs(args, root, tag, address, seeds, window)
        finally:
            perf_share = stop_perf(perf)
        with larder.Client(address) as client:
            st = client.stats()
        stats = {f: getattr(st, f) for f in ("memory_entries", "memory_bytes", "memory_budget_bytes",
                                             "hit_rate", "coalesced_fetches", "admissions_declined",
                                             "samples_served", "memory_policy_seconds",
                                             "memory_policy_bytes")}
        stats["daemon_cpu_seconds"] = cpu_seconds(daemon.pid)
        stats["policy_perf_share"] = perf_share
    finally:
        stop_daemon(daemon, tag, log)
    if not trace_path.exists():
        raise SystemExit(f"larderd ({tag}) wrote no trace at {trace_path}: does it have LARDER_TRACE?")
    trace = read_trace(trace_path)
    t = time.perf_counter()
    result = analyze(trace, capacity)
    belady_seconds = time.perf_counter() - t
    samples = sum(d["samples"] for d in done)
    seconds = max(d["end"] for d in done) - min(d["start"] for d in done)
    result.update(
        config=name, jobs=jobs, one_seed=one_seed, share=share, capacity=capacity, budget_bytes=budget,
        policy=policy, seeds=seeds, samples_delivered=samples, seconds=seconds, samples_per_s=samples / seconds,
        job_epoch_seconds=[d["epoch_seconds"] for d in done], daemon_stats=stats, belady_seconds=belady_seconds,
    )
    expected = jobs * args.epochs * args.samples
    note = "" if result["lookups"] == expected else f" (expected {expected:,}: one per sample delivered)"
    print(f"{tag}: {result['lookups']:,} lookups{note}, {result['hits']:,} hits ({result['joined']:,} joined), "
          f"{result['lower_reads']:,} lower-tier reads; Belady {result['belady_hits']:,} hits "
          f"({belady_seconds:.1f} s); daemon: hit_rate {st.hit_rate:.3f}, {st.memory_entries:,} entries of "
          f"{capacity:,} at the end, {st.admissions_declined:,} declined; {samples / seconds:,.0f} samples/s",
          flush=True)
    if len(result["datasets"]) != 1:
        print(f"  note: the trace names datasets {result['datasets']}; this run served one", flush=True)
    return result


# The policy's code, as perf names its functions: larder's eviction module, and the heaps only
# it uses (their generic functions are compiled outside it).
POLICY_SYMBOLS = re.compile(r"tiers::eviction::|BinaryHeap<")


def start_perf(args, path: pathlib.Path, pid: int):
    """`perf record` of the daemon while the jobs run, or None (--no-perf, or no perf here)."""
    if args.no_perf or not shutil.which("perf"):
        return None
    proc = subprocess.Popen(["perf", "record", "-q", "-F", "999", "-p", str(pid), "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return (proc, path) if proc.poll() is None else None


def stop_perf(perf):
    """The share of the daemon's CPU samples in the policy's code, or None."""
    if perf is None:
        return None
    proc, path = perf
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    out = subprocess.run(["perf", "report", "-i", str(path), "--no-children", "--sort", "sym", "--stdio", "-q"],
                         capture_output=True, text=True)
    path.unlink(missing_ok=True)
    share = 0.0
    for line in out.stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(.*)", line)
        if m and POLICY_SYMBOLS.search(m.group(2)):
            share += float(m.group(1)) / 100
    return share if out.returncode == 0 and out.stdout.strip() else None


def policy_share(stats: dict) -> str:
    """The policy's share of the daemon's CPU: perf's samples, and the daemon's own counter."""
    cpu = stats.get("daemon_cpu_seconds") or 0
    counter = pct(stats.get("memory_policy_seconds", 0) / cpu) if cpu else "-"
    perf = stats.get("policy_perf_share")
    return f"{counter} / {'-' if perf is None else pct(perf)}"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def print_table(rows, args, entry_cost) -> None:
    print()
    print(f"Memory-tier hits with concurrent jobs: {args.samples:,} samples 3x64x64 uint8 (one entry "
          f"{entry_cost:,} bytes: the record's allocation {entry_cost - ENTRY_OVERHEAD:,} + {ENTRY_OVERHEAD}), {args.epochs} "
          f"epochs per job, batch {args.batch}, shuffled, scratch tier off; Belady = MIN with bypass on "
          "the run's own lookup trace")
    print("| jobs | seeds | memory | policy | larder hits | Belady | gap (points) | "
          "lower reads / Belady misses | samples/s (aggregate) | policy CPU / daemon CPU: counter / perf |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["lookups"] or 1
        larder_rate, best_rate = r["hits"] / n, r["belady_hits"] / n
        ratio = r["lower_reads"] / r["belady_misses"] if r["belady_misses"] else float("nan")
        print(f"| {r['jobs']} | {SEEDS[r['one_seed']]} | "
              f"{round(r['share'] * 100)}% ({r['capacity']:,}) | {r['policy']} | "
              f"{pct(larder_rate)} (joined {pct(r['joined'] / n)}) | {pct(best_rate)} | "
              f"{100 * (best_rate - larder_rate):.1f} | "
              f"{r['lower_reads']:,} / {r['belady_misses']:,} = {ratio:.2f} | {r['samples_per_s']:,.0f} | "
              f"{policy_share(r['daemon_stats'])} |")


def table_rows(rows) -> list:
    """The printed table's figures, a dict per run."""
    out = []
    for r in rows:
        n = r["lookups"] or 1
        stats = r["daemon_stats"]
        cpu = stats.get("daemon_cpu_seconds") or 0
        out.append({
            "config": r["config"], "jobs": r["jobs"], "seeds": SEEDS[r["one_seed"]],
            "memory_pct": round(r["share"] * 100), "capacity": r["capacity"], "policy": r["policy"],
            "hits_pct": 100 * r["hits"] / n, "joined_pct": 100 * r["joined"] / n,
            "belady_pct": 100 * r["belady_hits"] / n, "gap_points": 100 * (r["belady_hits"] - r["hits"]) / n,
            "lower_reads": r["lower_reads"], "belady_misses": r["belady_misses"],
            "lower_reads_over_belady_misses": r["lower_reads"] / r["belady_misses"] if r["belady_misses"] else None,
            "samples_per_s": r["samples_per_s"],
            "policy_cpu_counter_pct": 100 * stats.get("memory_policy_seconds", 0) / cpu if cpu else None,
            "policy_cpu_perf_pct": None if stats.get("policy_perf_share") is None else 100 * stats["policy_perf_share"],
        })
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--larderd", default=os.environ.get("LARDERD_BIN", "target/release/larderd"))
    p.add_argument("--samples", type=int, default=5000, help="samples in the HDF5 file (N)")
    p.add_argument("--epochs", type=int, default=4, help="epochs each job streams, one after another")
    p.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="KxPP: K jobs, a memory tier of PP%% of the samples; a trailing s: one seed for all")
    p.add_argument("--policies", default="stale_lru,next_use", help="values of [memory] policy, each run in turn")
    p.add_argument("--json", help="write the results' JSON here instead of into --out (its CSV beside it)")
    p.add_argument("--dir", help="where the data, configs, traces and logs go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--timeout", type=float, default=900, help="seconds the jobs of one run may take")
    p.add_argument("--selftest", action="store_true", help="check the Belady implementation and exit")
    p.add_argument("--no-perf", action="store_true",
                   help="do not sample the daemon with perf (the policy's CPU share then comes from its counter only)")
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--job-seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--job-window", type=int, default=0, help=argparse.SUPPRESS)
    results.add_options(p)
    args = p.parse_args()
    if args.selftest:
        return selftest()
    if args.job:
        return job_main(args)
    configs = parse_configs(args.configs)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    if not policies:
        raise SystemExit("--policies: none given")
    larderd = pathlib.Path(args.larderd)
    if not larderd.is_file():
        raise SystemExit(f"no larderd at {larderd} (cargo build --release, or --larderd PATH)")
    args.larderd = str(larderd.resolve())
    if args.dir:
        root = pathlib.Path(args.dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = pathlib.Path(tempfile.mkdtemp(prefix="larder-jobs-"))
    ok = False
    try:
        h5 = write_images(root / "images.h5", args.samples)
        entry_cost = probe_entry_cost(args, root, h5)
        print(f"one memory-tier entry: {entry_cost:,} bytes (the record's allocation {entry_cost - ENTRY_OVERHEAD:,} + "
              f"{ENTRY_OVERHEAD} bookkeeping); {args.samples:,} samples; data, configs, traces and logs in {root}",
              flush=True)
        rows = []
        for jobs, share, one_seed in configs:
            for policy in policies:
                rows.append(run_one(args, root, h5, entry_cost, jobs, share, one_seed, policy))
        print_table(rows, args, entry_cost)
        meta = {"samples": args.samples, "shape": list(SHAPE), "epochs": args.epochs, "batch": args.batch,
                "entry_bytes": entry_cost, "entry_overhead": ENTRY_OVERHEAD, "larderd": args.larderd}
        results.save("jobs", args, table_rows(rows), json_path=args.json, meta=meta, runs=rows)
        ok = True
    finally:
        if not args.dir and not args.keep:
            if ok:
                shutil.rmtree(root, ignore_errors=True)
            else:
                print(f"kept {root} (configs, traces, logs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
