"""The Prometheus endpoint against a real daemon: the exposition, promtool's check, and a real
Prometheus server scraping it (Debian's `prometheus` package; scripts/setup installs it)."""

import json
import os
import shutil
import sys
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

import larder
from conftest import REPO, Daemon, make_h5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def scraped(tmp_path):
    """A daemon serving /metrics, a client streaming slowly while the test looks."""
    make_h5(tmp_path / "train.h5", 300)
    port = free_port()
    d = Daemon(tmp_path, f'[[dataset]]\nname = "train"\npath = "{tmp_path / "train.h5"}"\nlabels = "labels"\n',
               extra=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    stop = threading.Event()

    def slow():
        with larder.Client(d.unix) as c:
            while not stop.is_set():
                for _ in c.stream("train", 10, seed=1):
                    if stop.is_set():
                        return
                    time.sleep(0.02)

    t = threading.Thread(target=slow)
    t.start()
    try:
        yield d, f"http://127.0.0.1:{port}/metrics"
    finally:
        stop.set()
        t.join()
        d.stop()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def test_the_exposition_has_the_tiers_the_memory_and_each_open_stream(scraped):
    _, url = scraped
    deadline = time.monotonic() + 10
    while "larder_stream_samples{" not in (text := get(url)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for family in ("larder_lookups_total{tier=\"raw\"}", "larder_memory_bytes", "larder_memory_limit_bytes",
                   "larder_scratch_budget_bytes", "larder_machine_available_bytes", "larder_streams_open 1",
                   "larder_stream_wait_ratio{", "dataset=\"train\"", "run=\""):
        assert family in text, (family, text)
    assert "job=" not in text, "Prometheus renames a scraped job label"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)
    assert e.value.code == 404


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/setup)")
def test_promtool_accepts_the_exposition(scraped):
    _, url = scraped
    out = subprocess.run(["promtool", "check", "metrics"], input=get(url), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (scripts/setup)")
def test_a_real_prometheus_scrapes_it(scraped, tmp_path):
    _, url = scraped
    target = url.split("//")[1].split("/")[0]
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n"
        f"  - job_name: larder\n    static_configs:\n      - targets: ['{target}']\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        api = f"http://127.0.0.1:{port}/api/v1/query?query="
        found = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                for q in ("larder_lookups_total", "larder_stream_wait_seconds"):
                    r = json.loads(get(api + q))
                    found[q] = r["data"]["result"]
                if all(found.values()):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert found.get("larder_lookups_total"), (found, (tmp_path / "prometheus.log").read_text()[-2000:])
        streams = found["larder_stream_wait_seconds"]
        assert streams and streams[0]["metric"]["dataset"] == "train"
        assert streams[0]["metric"]["job"] == "larder", "the scrape job's own label, ours untouched"
    finally:
        prom.terminate()
        prom.wait()


def test_an_input_bound_job_and_a_compute_bound_one_are_told_apart(tmp_path):
    """Two clients of one dataset: one does nothing between batches (all its time is waiting for
    the next: input-bound), one works 0.3 s on each (larder has the next ready: compute-bound).
    The verdicts come out right within 5 s, from the Python API and from `larder top --once`."""
    from conftest import larder_binary

    make_h5(tmp_path / "big.h5", 6000, shape=(3, 64, 64))  # epochs longer than the test
    d = Daemon(tmp_path, f'[[dataset]]\nname = "big"\npath = "{tmp_path / "big.h5"}"\nlabels = "labels"\n',
               scratch="enabled = false\n", budget_bytes=1_000_000)
    # Two client processes (a job is a process: its streams, epoch after epoch, are judged
    # together).
    script = ("import sys, time, larder\n"
              "with larder.Client(sys.argv[1]) as c:\n"
              "    for e in range(1000):\n"
              "        for _ in c.stream('big', 64, seed=int(sys.argv[2]), epoch=e, prefetch=0):\n"
              "            time.sleep(float(sys.argv[3]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    jobs = [subprocess.Popen([sys.executable, "-c", script, d.unix, str(seed), str(work)], env=env)
            for seed, work in ((1, 0.0), (2, 0.3))]
    try:
        time.sleep(5)
        with larder.Client(d.unix) as c:
            rows = c.streams().streams
        by_pid = {r.pid: r.verdict for r in rows}
        assert by_pid == {jobs[0].pid: "input-bound", jobs[1].pid: "compute-bound"}, rows
        top = subprocess.run([str(larder_binary()), "--addr", d.unix, "top", "--once"],
                             capture_output=True, text=True, timeout=30)
        assert top.returncode == 0, top.stderr
        assert "input-bound" in top.stdout and "compute-bound" in top.stdout and "big" in top.stdout, top.stdout
        assert "memory tier" in top.stdout.splitlines()[0]
    finally:
        for j in jobs:
            j.kill()
            j.wait()
        d.stop()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed (scripts/setup)")
def test_larder_top_in_a_real_terminal_shows_the_streams_and_quits_on_q(scraped, tmp_path):
    from conftest import larder_binary

    d, _ = scraped
    session = f"larder-top-{os.getpid()}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "20",
                    f"{larder_binary()} --addr {d.unix} top; sleep 30"], check=True)
    try:
        screen = ""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                    capture_output=True, text=True).stdout
            if "STREAM" in screen and "train" in screen:
                break
            time.sleep(0.2)
        assert "STREAM" in screen and "train" in screen and "memory tier" in screen, screen
        pid = subprocess.run(["tmux", "display-message", "-p", "-t", session, "#{pane_pid}"],
                             capture_output=True, text=True).stdout.strip()
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        # top quits: only the shell's `sleep` is left under the pane.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            children = subprocess.run(["pgrep", "-P", pid, "-a"], capture_output=True, text=True).stdout
            if " top" not in children:
                break
            time.sleep(0.2)
        assert " top" not in children, children
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
