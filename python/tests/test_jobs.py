"""Several jobs, one cache, through the real daemon: the memory tier's hits next to Belady's
offline optimum on the lookups the daemon recorded in the same run (benches/jobs.py, small)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, larderd_binary


@pytest.mark.quiet
def test_concurrent_jobs_get_within_five_points_of_the_offline_optimum(tmp_path):
    out = tmp_path / "jobs.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    run = subprocess.run(
        [sys.executable, str(REPO / "benches" / "jobs.py"), "--larderd", str(larderd_binary()),
         "--samples", "600", "--epochs", "3", "--configs", "2x50,4x25,3x35s,4x25s",
         "--policies", "next_use", "--json", str(out), "--dir", str(tmp_path / "runs")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = results["runs"] if isinstance(results, dict) else results
    assert len(rows) == 4
    for r in rows:
        n = r["lookups"]
        # Every job read every sample of every epoch once (the bench checks the ids).
        assert n == r["jobs"] * 3 * 600
        gap = (r["belady_hits"] - r["hits"]) / n
        assert gap <= 0.05, f"{r['config']}: {r['hits'] / n:.3f} against Belady {r['belady_hits'] / n:.3f}"
        assert r["lower_reads"] <= 1.1 * r["belady_misses"], r["config"]
        # What `larder stats` reports is what the trace shows: its hit rate is memory hits over
        # the lookups that did not join a read already in flight.
        memory_hits = r["hits"] - r["joined"]
        reported = r["daemon_stats"]["hit_rate"]
        assert abs(reported - memory_hits / (n - r["joined"])) < 0.01, (r["config"], reported)
