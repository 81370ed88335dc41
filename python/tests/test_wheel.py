"""The client as users install it: a wheel built from python/ (its generated stubs inside),
installed into a fresh virtual environment with nothing of the repository on its path, streams
from a real daemon."""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from conftest import Daemon, h5_table, make_h5

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_wheel_installs_into_a_fresh_venv_and_streams(tmp_path):
    # Built with this environment's setuptools (pyproject's build-system needs 77 or later).
    pytest.importorskip("setuptools", minversion="77")
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(dist), str(REPO / "python")], check=True, cwd=tmp_path)
    (wheel,) = dist.glob("larder_client-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"larder/v1/larder_pb2.py", "larder/v1/larder_pb2_grpc.py", "larder/client.py"} <= set(names)
    assert not any(n.startswith("tests/") for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)], check=True, env=env, timeout=600)
    make_h5(tmp_path / "a.h5", 40)
    d = Daemon(tmp_path, h5_table("a", tmp_path / "a.h5"))
    try:
        script = (
            "import sys, warnings, larder\n"
            "warnings.simplefilter('error')\n"
            f"assert larder.__file__.startswith({str(venv)!r}), larder.__file__\n"
            f"with larder.Client({d.unix!r}) as c:\n"
            "    ids = sorted(int(i) for b in c.stream('a', 8, seed=1) for i in b.sample_ids)\n"
            "    assert ids == list(range(40)), ids\n"
            "    print(larder.__version__, c.info().version)\n"
        )
        out = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        client, daemon = out.stdout.split()
        assert client == daemon
    finally:
        d.stop()
