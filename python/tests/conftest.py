"""Fixtures: real HDF5 files and a real larderd process (built by the README's test command)."""

import os
import pathlib
import signal
import socket
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


def make_h5(path: pathlib.Path, n: int, shape=SHAPE) -> None:
    length = int(np.prod(shape))
    data = np.stack([sample(i, length) for i in range(n)]).reshape((n,) + tuple(shape))
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=data)
        f.create_dataset("labels", data=np.arange(n, dtype=np.int64) % 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def larderd_binary() -> pathlib.Path:
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    path = pathlib.Path(os.environ.get("LARDERD_BIN", target / "debug" / "larderd"))
    if not path.exists():
        pytest.fail(f"{path} not found: run `cargo build --bin larderd` (./scripts/test does)")
    return path


class Daemon:
    """larderd on a Unix socket and a TCP port, from a config written to tmp_path."""

    def __init__(self, tmp_path: pathlib.Path, datasets: str, extra: str = ""):
        self.socket = tmp_path / "larder.sock"
        self.port = free_port()
        self.config = tmp_path / "larder.toml"
        self.config.write_text(
            f'listen = "127.0.0.1:{self.port}"\n'
            f'unix_socket = "{self.socket}"\n'
            "[scratch]\n"
            f'dir = "{tmp_path / "scratch"}"\n'
            "[memory]\n"
            "budget_bytes = 10000000\n" + extra + datasets
        )
        self.log = open(tmp_path / "larderd.log", "ab")
        self.proc = None
        self.start()

    @property
    def unix(self) -> str:
        return f"unix:{self.socket}"

    @property
    def tcp(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(larderd_binary()), "--config", str(self.config)], stderr=self.log
        )
        deadline = time.monotonic() + 20
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"larderd did not start; see {self.log.name}")
            time.sleep(0.02)

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)
        if sig == signal.SIGKILL and self.socket.exists():
            self.socket.unlink()  # as a crashed daemon leaves it; a new one would replace it


def quadrant_daemon(tmp_path, n: int) -> Daemon:
    """larderd serving "quad", a learnable set: the class decides which quadrant is bright."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, n)
    images = rng.integers(0, 60, (n, 3, 16, 16), dtype=np.uint8)
    for i, c in enumerate(labels):
        y, x = divmod(int(c), 2)
        images[i, :, y * 8 : y * 8 + 8, x * 8 : x * 8 + 8] += 150
    with h5py.File(tmp_path / "quad.h5", "w") as f:
        f.create_dataset("images", data=images)
        f.create_dataset("labels", data=labels.astype(np.int64))
    return Daemon(tmp_path, f'[[dataset]]\nname = "quad"\npath = "{tmp_path / "quad.h5"}"\nlabels = "labels"\n')


@pytest.fixture
def h5_dataset(tmp_path):
    make_h5(tmp_path / "train.h5", 300)
    return f'[[dataset]]\nname = "train"\npath = "{tmp_path / "train.h5"}"\nlabels = "labels"\n'


@pytest.fixture
def daemon(tmp_path, h5_dataset):
    d = Daemon(tmp_path, h5_dataset)
    yield d
    d.stop()
