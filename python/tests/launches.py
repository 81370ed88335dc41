"""Scripts under the training frameworks, run together: the tests register their runs at import
(each with its script, arguments and the setup the script needs), and each group of runs that
starts alike (one Python process, one that starts its own Lightning DDP ranks, or torchrun with
two ranks) is launched once per session, its runs one after another in one process per rank
(frameworks/runs.py): Python, torch and the frameworks are imported once per group rather than
once per run, which is most of a run's time. A test then reads its run's outcome (running one
test launches its whole group).

Order within a group: a process that has used gRPC cannot fork DataLoader workers safely, so
the runs whose main process never opens a connection (their DataLoader workers do) come first,
then those that fork workers and open one afterwards, then those that open one at once.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

REPO = pathlib.Path(__file__).resolve().parents[2]
FRAMEWORKS = pathlib.Path(__file__).resolve().parent / "frameworks"
EXAMPLES = REPO / "python" / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

# How a run's main process uses gRPC (see the module's text), in the order runs go.
NO_GRPC, FORKS_THEN_GRPC, GRPC = 0, 1, 2

# A group that takes longer than this hangs: its processes' stacks are shown and it is killed.
GROUP_TIMEOUT = 480


def stacks(session: int) -> str:
    """Python stacks of every process in session `session` (py-spy, where installed)."""
    spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    pids = subprocess.run(["ps", "-o", "pid=", "-s", str(session)], capture_output=True, text=True).stdout
    out = []
    for pid in pids.split():
        try:
            dump = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60)
            out.append(f"--- process {pid}\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.SubprocessError) as e:
            out.append(f"--- process {pid}: no stack ({e})")
    return "\n".join(out)


class Outcome:
    """What a run left: `ok` (every rank's run ended without error), `error`, and its ranks'
    stdout and stderr, one rank after the other."""

    def __init__(self, ok: bool, error: str, stdout: str, stderr: str):
        self.ok, self.error, self.stdout, self.stderr = ok, error, stdout, stderr

    def failure(self) -> str:
        return f"{self.error}\n--- stdout\n{self.stdout[-2000:]}\n--- stderr\n{self.stderr[:3000]}\n[...]\n" \
               f"{self.stderr[-3000:]}"


class Run:
    """One script's run in a group. `args` and `env` values may name "{out}" (the run's own
    folder: its working directory, where it writes), another run's ("{runs[NAME]}") and the
    session's daemons ("{train}", "{quad}", "{folders}": see conftest's `services`);
    `setup(out)` makes what the run reads before the group starts."""

    def __init__(self, group: "Group", name: str, script: pathlib.Path, args, env, call: bool, grpc: int,
                 may_fail: bool, setup: Optional[Callable[[pathlib.Path], None]]):
        self.group, self.name, self.script = group, name, script
        self.args, self.env, self.call, self.grpc = [str(a) for a in args], dict(env or {}), call, grpc
        self.may_fail, self.setup = may_fail, setup
        self.out: Optional[pathlib.Path] = None

    def spec(self, services: Dict[str, str]) -> dict:
        runs = {r.name: r.out for r in self.group.runs}

        def fill(text: str) -> str:
            return text.format(out=self.out, runs=runs, **services)

        return {"name": self.name, "script": str(self.script), "args": [fill(a) for a in self.args],
                "env": {k: fill(v) for k, v in self.env.items()}, "cwd": str(self.out), "call": self.call,
                "may_fail": self.may_fail, "port": self.group.ports, "fresh": self.group.ports}

    def outcome(self) -> Outcome:
        """The run's outcome, once its group has ended."""
        folder = self.group.logs / self.name
        ranks = [str(r) for r in range(self.group.ranks)]
        statuses = []
        for r in ranks:
            path = folder / f"status-{r}.json"
            statuses.append(json.loads(path.read_text()) if path.exists() else None)
        read = lambda kind: "".join((folder / f"{kind}-{r}.txt").read_text(errors="replace")  # noqa: E731
                                    for r in ranks if (folder / f"{kind}-{r}.txt").exists())
        stdout, stderr = read("stdout"), read("stderr")
        if all(s is not None and s["ok"] for s in statuses):
            return Outcome(True, "", stdout, stderr)
        errors = [f"rank {r}: {s['error']}" for r, s in zip(ranks, statuses) if s is not None and not s["ok"]]
        if any(s is None for s in statuses):
            errors.append(f"not run to its end: the group {self.group.name} stopped "
                          f"({self.group.problem or 'see its log'}); its log:\n{self.group.log_tail()}")
        return Outcome(False, "; ".join(errors), stdout, stderr)


class Group:
    """Runs launched together: `launcher` + frameworks/runs.py, `ranks` processes, each running
    every run; `ports`: each run gets a rendezvous port of its own (torchrun)."""

    def __init__(self, name: str, launcher: List[str], ranks: int, ports: bool):
        self.name, self.launcher, self.ranks, self.ports = name, launcher, ranks, ports
        self.runs: List[Run] = []
        self.proc: Optional[subprocess.Popen] = None
        self.logs: Optional[pathlib.Path] = None
        self.problem = ""
        self.seconds = 0.0

    def add(self, name: str, script, *args, env=None, call=False, grpc=GRPC, may_fail=False, setup=None) -> Run:
        run = Run(self, name, pathlib.Path(script), args, env, call, grpc, may_fail, setup)
        assert all(r.name != name for r in self.runs), name
        self.runs.append(run)
        return run

    def start(self, folder: pathlib.Path, services: Dict[str, str]) -> None:
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True)
        ordered = sorted(self.runs, key=lambda r: r.grpc)  # stable: in the order registered
        for run in ordered:
            run.out = folder / run.name
            run.out.mkdir()
            if run.setup is not None:
                run.setup(run.out)
        plan = folder / "plan.json"
        plan.write_text(json.dumps({"logs": str(self.logs), "runs": [r.spec(services) for r in ordered]}, indent=1))
        # One thread per process for torch's operators, as torchrun sets it: the groups share the
        # cores with each other and the daemons, and idle OpenMP threads spin.
        env = dict(os.environ, PYTHONPATH=str(REPO / "python"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.log = open(folder / "group.log", "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.launcher + [str(FRAMEWORKS / "runs.py"), str(plan)], cwd=folder,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self.proc.wait(timeout=max(1.0, GROUP_TIMEOUT - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            where = stacks(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.problem = f"hung for {GROUP_TIMEOUT} s; stacks:\n{where}"
        else:
            if self.proc.returncode != 0:
                self.problem = f"exit status {self.proc.returncode}"
        self.seconds = time.monotonic() - self.started
        self.log.close()
        self.kill()

    def kill(self) -> None:
        """Ends whatever is left of the group (its processes share its session)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self.proc.returncode is None:
                self.proc.wait()

    def log_tail(self) -> str:
        return (self.logs.parent / "group.log").read_text(errors="replace")[-4000:]


PYTHON = Group("python", [sys.executable], ranks=1, ports=False)
# Lightning starts its DDP ranks itself: it runs frameworks/runs.py again for rank 1.
LIGHTNING_DDP = Group("lightning-ddp", [sys.executable], ranks=2, ports=False)
TORCHRUN_GROUP = Group("torchrun", TORCHRUN, ranks=2, ports=True)
GROUPS = [PYTHON, LIGHTNING_DDP, TORCHRUN_GROUP]


class Launched:
    """The session's groups: `launched(run)` is the run's outcome, its group launched (once)
    and waited for."""

    def __init__(self, folder: pathlib.Path, services: Dict[str, str]):
        self.folder, self.services = folder, services

    def start(self) -> None:
        """Starts every group that has runs: they go side by side, with each other and with the
        tests that do not read them, each keeping a core busy where another waits (on a launch,
        a rendezvous, the daemon)."""
        for group in GROUPS:
            if group.proc is None and group.runs:
                group.start(self.folder / group.name, self.services)

    def wait(self) -> None:
        """Waits until every group started has ended."""
        for group in GROUPS:
            group.wait()

    def __call__(self, run: Run) -> Outcome:
        self.start()
        run.group.wait()
        return run.outcome()

    def close(self) -> None:
        for group in GROUPS:
            group.kill()
