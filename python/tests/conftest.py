"""Fixtures: real HDF5 files and real larderd processes (built by the README's test command), and
the order the tests run in (see `pytest_collection_modifyitems`)."""

import ctypes
import os
import pathlib
import re
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

try:
    import torch
except ImportError:  # the oldest-dependencies environment (scripts/setup) has no torch
    torch = None

REPO = pathlib.Path(__file__).resolve().parents[2]
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed here")
SHAPE = (2, 4, 4)


def sample(i: int, length: int) -> np.ndarray:
    """The synthetic sample the Rust side's `larder::demo` also writes and checks."""
    return ((i * 131 + np.arange(length) * 7) % 251).astype(np.uint8)


def sample_ids(images, labels, n: int = 300) -> list:
    """Which samples of make_h5's data a batch holds, read back from the pixels: pixel 0 of
    sample i is (i * 131) % 251 and its label i % 10, which together name i < n <= 2510."""
    out = []
    for img, label in zip(images, labels):
        first, label = int(img.reshape(-1)[0]), int(label)
        match = [i for i in range(n) if (i * 131) % 251 == first and i % 10 == label]
        assert len(match) == 1, (first, label)
        out.append(match[0])
    return out


def buffer_span(buf) -> tuple:
    """(first address, end address) of the memory of `buf`: a bytes object (its own bytes,
    through ctypes, no copy) or a writable buffer such as the mmap of a shared-memory ring."""
    if isinstance(buf, bytes):
        start = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value
    else:
        view = ctypes.c_char.from_buffer(buf)  # exports buf while it lives: dropped at once
        start = ctypes.addressof(view)
        del view
    return start, start + len(buf)


def data_span(arr: np.ndarray) -> tuple:
    """(first address, end address) of the bytes an array's elements lie in (C-contiguous)."""
    assert arr.flags.c_contiguous
    start = arr.__array_interface__["data"][0]
    return start, start + arr.nbytes


def within(arr: np.ndarray, span: tuple) -> bool:
    """Whether every byte of `arr` lies inside the memory `span` (from buffer_span)."""
    start, end = data_span(arr)
    return span[0] <= start and end <= span[1]


def ring_span(ring) -> tuple:
    """(first address, end address) of the slots of a larder.shm.Ring as this process maps it."""
    start, end = buffer_span(ring._mm)
    assert end - start == ring.size
    return start + ring.header, end


def ring_maps(pid: int) -> set:
    """The shared-memory rings process `pid` maps: (first address, end address, inode) of each
    of its mappings of a memfd named larder-ring ("/memfd:larder-ring (deleted)" in its maps:
    anonymous memory, in no filesystem)."""
    maps = set()
    for line in open(f"/proc/{pid}/maps"):
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/memfd:larder-ring"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.add((lo, hi, int(parts[4])))
    return maps


def in_a_ring(arr: np.ndarray) -> bool:
    """Whether every byte of `arr` lies in a shared-memory ring this process maps."""
    return any(within(arr, (lo, hi)) for lo, hi, _ in ring_maps(os.getpid()))


def make_h5(path: pathlib.Path, n: int, shape=SHAPE) -> None:
    length = int(np.prod(shape))
    data = np.stack([sample(i, length) for i in range(n)]).reshape((n,) + tuple(shape))
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=data)
        f.create_dataset("labels", data=np.arange(n, dtype=np.int64) % 10)


def _binary(name: str, override: str) -> pathlib.Path:
    """target/debug/NAME of this checkout, under $CARGO_TARGET_DIR when it is set (relative to
    the repository, where ./scripts/test runs cargo), or $OVERRIDE itself."""
    target = REPO / os.environ.get("CARGO_TARGET_DIR", "target")
    path = pathlib.Path(os.environ.get(override, target / "debug" / name))
    if not path.exists():
        pytest.fail(f"{path} not found: run `cargo build --bin {name}` (./scripts/test does), "
                    f"or set {override}")
    return path


def larderd_binary() -> pathlib.Path:
    """The daemon: $LARDERD_BIN, else target/debug/larderd (see _binary)."""
    return _binary("larderd", "LARDERD_BIN")


def larder_binary() -> pathlib.Path:
    """The command-line client: $LARDER_BIN, else target/debug/larder (see _binary)."""
    return _binary("larder", "LARDER_BIN")


def wait_for_address(proc: subprocess.Popen, path: pathlib.Path, log: str, timeout: float = 20) -> str:
    """The address larderd `proc`, started with `--address-file PATH`, wrote once listening
    (it writes PATH.tmp and renames it, so the file appears whole). Raises RuntimeError ("did
    not start") when larderd exits first or nothing appears within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"larderd did not start: it exited with status {code}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"larderd did not start: no {path} after {timeout:.0f} s; see {log}")
        time.sleep(0.02)
    address = path.read_text().strip()
    if not address.startswith("http://"):
        raise RuntimeError(f"larderd wrote {address!r} to {path}, not an http:// address")
    return address


class Daemon:
    """larderd on a Unix socket and a TCP port the kernel picks (`listen = "127.0.0.1:0"`), from
    a config written to tmp_path; the port is read back from the file `--address-file` names.
    A restart (stop, then start) gets a port of its own: clients that reconnect across a
    restart use the Unix socket. Every dataset is marked `tcp = true` (TCP clients, which have
    no identity, get only datasets so marked): the tests use both transports."""

    def __init__(self, tmp_path: pathlib.Path, datasets: str, extra: str = "", scratch: str = "",
                 budget_bytes: int = 10_000_000, top: str = ""):
        """`extra`: lines for the [memory] table (after its budget_bytes), then any tables;
        `scratch`: lines for the [scratch] table (its dir is tmp_path/scratch); `top`: top-level
        keys (`reader_user = ...`)."""
        self.socket = tmp_path / "larder.sock"
        self.address_file = tmp_path / "larderd.address"
        self.address = None  # "http://127.0.0.1:PORT", once started
        self.config = tmp_path / "larder.toml"
        datasets = re.sub(r'(\[\[dataset\]\]\n\s*name = "[^"]*"\n)', r"\1tcp = true\n", datasets)
        self.config.write_text(
            top + 'listen = "127.0.0.1:0"\n'
            f'unix_socket = "{self.socket}"\n'
            f'state_dir = "{tmp_path / "state"}"\n'
            "[scratch]\n"
            f'dir = "{tmp_path / "scratch"}"\n' + scratch + "[memory]\n"
            f"budget_bytes = {budget_bytes}\n" + extra + datasets
        )
        self.log = open(tmp_path / "larderd.log", "ab")
        self.proc = None
        self.start()

    @property
    def unix(self) -> str:
        return f"unix:{self.socket}"

    @property
    def tcp(self) -> str:
        return self.address

    def start(self) -> None:
        self.address_file.unlink(missing_ok=True)  # a killed daemon's, from before
        self.proc = subprocess.Popen(
            [str(larderd_binary()), "--config", str(self.config), "--address-file", str(self.address_file)],
            stderr=self.log,
        )
        self.address = wait_for_address(self.proc, self.address_file, self.log.name)
        if not self.socket.exists():
            raise RuntimeError(f"larderd listens at {self.address} but made no {self.socket}; see {self.log.name}")

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)
        if sig == signal.SIGKILL and self.socket.exists():
            self.socket.unlink()  # as a crashed daemon leaves it; a new one would replace it


def write_quadrants(path: pathlib.Path, n: int) -> None:
    """A learnable set of n 3x16x16 images: the class (0-3) decides which quadrant is bright."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, n)
    images = rng.integers(0, 60, (n, 3, 16, 16), dtype=np.uint8)
    for i, c in enumerate(labels):
        y, x = divmod(int(c), 2)
        images[i, :, y * 8 : y * 8 + 8, x * 8 : x * 8 + 8] += 150
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=images)
        f.create_dataset("labels", data=labels.astype(np.int64))


def h5_table(name: str, path: pathlib.Path) -> str:
    """The [[dataset]] table of an HDF5 file of "images" and "labels"."""
    return f'[[dataset]]\nname = "{name}"\npath = "{path}"\nlabels = "labels"\n'


@pytest.fixture
def h5_dataset(tmp_path):
    make_h5(tmp_path / "train.h5", 300)
    return h5_table("train", tmp_path / "train.h5")


@pytest.fixture
def daemon(tmp_path, h5_dataset):
    d = Daemon(tmp_path, h5_dataset)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """{name: Unix address} of the session's daemons, which the launched runs (launches.py) and
    the tests that only read stream from: "train" (make_h5's 300 samples), "quad"
    (write_quadrants' 512, and "quad-513"), and "folders" (no dataset of its own: the runs add
    theirs by path)."""
    train, quad, folders = (tmp_path_factory.mktemp(name) for name in ("train", "quad", "folders"))
    make_h5(train / "train.h5", 300)
    write_quadrants(quad / "quad.h5", 512)
    write_quadrants(quad / "quad-513.h5", 513)
    daemons = {
        "train": Daemon(train, h5_table("train", train / "train.h5")),
        "quad": Daemon(quad, h5_table("quad", quad / "quad.h5") + h5_table("quad-513", quad / "quad-513.h5")),
        "folders": Daemon(folders, ""),
    }
    yield {name: d.unix for name, d in daemons.items()}
    for d in daemons.values():
        d.stop()


@pytest.fixture(scope="session")
def launched(tmp_path_factory, services):
    """`launched(run)`: the outcome of a run registered in launches.py's groups, its group
    launched once for the session."""
    from launches import Launched

    runs = Launched(tmp_path_factory.mktemp("launched"), services)
    yield runs
    runs.close()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quiet: asserts how fast things go; runs after the other tests, once the launched groups "
        "(launches.py) have ended, on a machine left to it")


def pytest_collection_modifyitems(session, config, items):
    """The order the tests run in: those that read the launched groups after the others, which
    run while the groups do (started with the session: `groups_start_first`), and the quiet
    ones last (see `pytest_configure`)."""
    def place(item) -> int:
        if item.get_closest_marker("quiet") is not None:
            return 2
        return 1 if "launched" in item.fixturenames else 0

    items.sort(key=place)  # stable: each part in the order collected


@pytest.fixture(scope="session", autouse=True)
def groups_start_first(request):
    """The launched groups, when any test reads them, start with the session: they run while
    the other tests do."""
    if any("launched" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("launched").start()
    yield


@pytest.fixture(autouse=True)
def quiet_machine(request):
    """A quiet test waits for the launched groups to end."""
    if request.node.get_closest_marker("quiet") is not None and \
            any("launched" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("launched").wait()
    yield

