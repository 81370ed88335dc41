"""The Prometheus endpoint against a real daemon: the exposition, promtool's check, and a real
Prometheus server scraping it (Debian's `prometheus` package; scripts/setup installs it)."""

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

import larder
from conftest import Daemon, make_h5


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
