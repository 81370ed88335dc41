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
                   "larder_stream_wait_ratio{", "dataset=\"train\"", "run=\"", "larder_stream_verdict{",
                   "larder_stream_recent_samples{", "larder_pool_busy_ratio", "larder_batch_wait_seconds_bucket{le=",
                   "larder_batch_wait_seconds_count", "larder_dataset_lookups_total{dataset=\"train\",tier=\"raw\"}",
                   "larder_dataset_read_bytes_total{dataset=\"train\",tier=", "larder_dataset_bad_samples{dataset=\"train\"} 0",
                   "larder_memory_budget_bytes", "larder_message_budget_bytes", "larder_message_in_flight_bytes"):
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
                for q in ("larder_lookups_total", "larder_stream_wait_seconds", "larder_batch_wait_seconds_count"):
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


@pytest.mark.quiet
def test_an_input_bound_job_and_a_compute_bound_one_are_told_apart(tmp_path):
    """Two client processes on one dataset: one does nothing between batches (all its time is
    waiting for the next: input-bound), one works 0.3 s on each (larder has the next ready:
    compute-bound). The clients measure their loops and report them; the verdicts come out right
    within 5 s in each job's own `input_stats()` (judged by the thresholds the daemon answers
    with), in `ListStreams` and in `larder top --once`, with the input-bound one's cause (its
    samples come from the raw file) and fix. Another process's report on a stream not its own
    is refused."""
    from conftest import larder_binary
    from larder.v1 import larder_pb2 as pb
    import grpc

    make_h5(tmp_path / "big.h5", 6000, shape=(3, 64, 64))  # epochs longer than the test
    d = Daemon(tmp_path, f'[[dataset]]\nname = "big"\npath = "{tmp_path / "big.h5"}"\nlabels = "labels"\n',
               scratch="enabled = false\n", budget_bytes=1_000_000)
    # Each job writes its own view of itself to a file every half second.
    script = ("import json, sys, time, larder\n"
              "out, last = sys.argv[4], 0.0\n"
              "with larder.Client(sys.argv[1], job=sys.argv[5]) as c:\n"
              "    for e in range(1000):\n"
              "        for _ in c.stream('big', 64, seed=int(sys.argv[2]), epoch=e, prefetch=0):\n"
              "            time.sleep(float(sys.argv[3]))\n"
              "            if time.monotonic() - last > 0.5:\n"
              "                last = time.monotonic()\n"
              "                open(out + '.tmp', 'w').write(json.dumps(c.input_stats('big').as_dict()))\n"
              "                __import__('os').replace(out + '.tmp', out)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    jobs = [subprocess.Popen([sys.executable, "-c", script, d.unix, str(seed), str(work),
                              str(tmp_path / f"{name}.json"), name], env=env)
            for seed, work, name in ((1, 0.0, "eager"), (2, 0.3, "thinker"))]

    def told_apart(c):
        """Checks the verdicts, in the daemon and in each job's own view, with their causes;
        returns the eager job's stream."""
        rows = c.streams().streams
        by_job = {r.job: r for r in rows}
        assert {r.pid for r in rows} == {j.pid for j in jobs}, rows
        assert set(by_job) == {"eager", "thinker"}, rows
        eager, thinker = by_job["eager"], by_job["thinker"]
        assert (eager.verdict, thinker.verdict) == ("input-bound", "compute-bound"), rows
        assert eager.measured_by_client and thinker.measured_by_client, rows
        assert eager.cause in ("raw reads", "preprocessing") and "larder warm big" in eager.advice, eager
        assert thinker.cause == "" and thinker.advice == "", thinker
        assert eager.raw_samples > 0 and eager.memory_samples < eager.raw_samples, eager
        # The thinker's loop waits under 5% of its step time; the eager one most of it.
        assert thinker.wait_ratio < 0.05 < 0.2 < eager.wait_ratio, rows
        mine = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("eager", "thinker")}
        assert mine["eager"]["verdict"] == "input-bound" and mine["eager"]["wait_ratio"] > 0.2, mine
        assert mine["eager"]["cause"] in ("raw reads", "preprocessing"), mine
        assert mine["thinker"]["verdict"] == "compute-bound" and mine["thinker"]["step_seconds"] > 1, mine
        return eager

    try:
        # Right within 5 s: looked at as the jobs go, until right (or 5 s have passed).
        deadline = time.monotonic() + 5
        with larder.Client(d.unix) as c:
            while True:
                try:
                    eager = told_apart(c)
                    break
                except (AssertionError, OSError, ValueError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.25)
            # Not this process's stream: refused, and the stream's measure is untouched.
            with pytest.raises(grpc.RpcError) as e:
                c._stub.ReportInput(pb.ReportInputRequest(stream_id=eager.id, job="forged",
                                                          window_wait_seconds=0.0, window_step_seconds=100.0))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert {r.job for r in c.streams().streams} == {"eager", "thinker"}
        words = ("input-bound", "compute-bound", "eager", "thinker", "big", "larder warm big")
        for _ in range(20):  # a job between two epochs has no stream open for a moment
            top = subprocess.run([str(larder_binary()), "--addr", d.unix, "top", "--once"],
                                 capture_output=True, text=True, timeout=30)
            assert top.returncode == 0, top.stderr
            if all(w in top.stdout for w in words):
                break
            time.sleep(0.25)
        for word in words:
            assert word in top.stdout, (word, top.stdout)
        assert "memory tier" in top.stdout.splitlines()[0] and "pool" in top.stdout.splitlines()[0]
    finally:
        for j in jobs:
            j.kill()
            j.wait()
        d.stop()


@pytest.mark.quiet
def test_an_input_bound_job_is_told_the_cause_and_fix_once_in_its_log(tmp_path):
    """By default a job that has been input-bound for a while logs one line through `logging`
    naming the cause and the fix (here after 1 s: $LARDER_ADVICE_AFTER), and only one: the job
    goes on input-bound after it."""
    make_h5(tmp_path / "big.h5", 3000, shape=(3, 64, 64))
    d = Daemon(tmp_path, f'[[dataset]]\nname = "big"\npath = "{tmp_path / "big.h5"}"\nlabels = "labels"\n',
               scratch="enabled = false\n", budget_bytes=1_000_000)
    script = ("import logging, sys, time, larder\n"
              "logging.basicConfig(level=logging.INFO)\n"
              "with larder.Client(sys.argv[1], job='eager') as c:\n"
              "    t = time.monotonic()\n"
              "    while time.monotonic() - t < 4:\n"
              "        for _ in c.stream('big', 64, epoch=int(time.monotonic()), prefetch=0):\n"
              "            pass\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "LARDER_ADVICE_AFTER": "1"}
    try:
        out = subprocess.run([sys.executable, "-c", script, d.unix], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        advice = [line for line in out.stderr.splitlines() if "input-bound" in line]
        assert len(advice) == 1, out.stderr
        assert "eager" in advice[0] and "larder warm big" in advice[0], advice
    finally:
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
            if "VERDICT" in screen and "train" in screen:
                break
            time.sleep(0.2)
        assert "VERDICT" in screen and "train" in screen and "memory tier" in screen, screen
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
