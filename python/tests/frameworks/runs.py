"""Runs several scripts in one process, one after another, each as it would run on its own: its
arguments, environment, working directory, and, under torchrun, a rendezvous port of its own
(a process group re-made on the same store would read the last one's addresses). Python, torch
and the frameworks are imported once for all of them, which is most of a script's time here.

    python runs.py PLAN                        (Lightning's DDP starts this again for rank 1)
    torchrun --nproc_per_node 2 runs.py PLAN

PLAN is JSON: {"logs": LOGS, "runs": [{"name", "script", "args", "env", "cwd", "call",
"port", "fresh", "may_fail"}, ...]}. A run's output goes to LOGS/NAME/stdout-RANK.txt and
stderr-RANK.txt (file descriptors 1 and 2, so DataLoader workers, logging and C code land there
too), its outcome to status-RANK.json. `call`: the script's main(args) is called with sys.argv
left alone (Lightning starts its DDP ranks again from sys.argv); else the script runs as
__main__ with its arguments in sys.argv. `port`: a rendezvous port of the run's own. `fresh`:
Accelerate's process-wide state and a process group left over go first. A run that fails stops
this process (under torchrun the other rank would wait for it in a collective), unless
`may_fail`: then both ranks fail alike, and the next run goes on.
"""

import gc
import importlib.util
import json
import os
import pathlib
import runpy
import socket
import sys
import time
import traceback


def rank() -> str:
    return os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"


class Redirected:
    """File descriptors 1 and 2 onto a run's files for the length of the run."""

    def __init__(self, folder: pathlib.Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.files = [open(folder / f"{kind}-{rank()}.txt", "ab") for kind in ("stdout", "stderr")]

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        for fd, f in zip((1, 2), self.files):
            os.dup2(f.fileno(), fd)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        for f in self.files:
            f.close()


def fresh_frameworks() -> None:
    """What a fresh process starts without: Accelerate's process-wide state (a run's Accelerator
    would find the last run's, its process group gone) and the default process group of a run
    that failed midway."""
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def port(folder: pathlib.Path) -> int:
    """A free port for the run's rendezvous, picked by rank 0 as the run starts and read by the
    others from the run's folder."""
    path = folder / "port"
    if rank() == "0":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            chosen = s.getsockname()[1]
        path.with_suffix(".tmp").write_text(str(chosen))
        path.with_suffix(".tmp").rename(path)
        return chosen
    deadline = time.monotonic() + 300
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 gave no port in {path}")
        time.sleep(0.01)
    return int(path.read_text())


def run(spec: dict, logs: pathlib.Path) -> dict:
    cwd, argv = os.getcwd(), list(sys.argv)
    env = dict(spec.get("env", {}))
    (logs / spec["name"]).mkdir(parents=True, exist_ok=True)
    if spec.get("port"):
        # A store of the run's own, on rank 0, rather than torchrun's (see the module's text).
        env.update(MASTER_PORT=str(port(logs / spec["name"])), TORCHELASTIC_USE_AGENT_STORE="False")
    # The run's variables, put back as they were after it. What the run sets itself stays, as it
    # would in the process: Lightning's LOCAL_RANK says its DDP ranks are started.
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.chdir(spec["cwd"])
    started = time.monotonic()
    outcome = {"ok": True, "error": ""}
    with Redirected(logs / spec["name"]):
        try:
            if spec.get("call"):
                loader = importlib.util.spec_from_file_location(pathlib.Path(spec["script"]).stem, spec["script"])
                module = importlib.util.module_from_spec(loader)
                loader.loader.exec_module(module)
                module.main(spec["args"])
            else:
                sys.argv = [spec["script"], *spec["args"]]
                runpy.run_path(spec["script"], run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                outcome = {"ok": False, "error": f"exit status {e.code}"}
                traceback.print_exc()
        except BaseException as e:  # recorded for the test, which says what went wrong
            outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        finally:
            sys.argv = argv
            os.chdir(cwd)
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            gc.collect()  # the run's DataLoader iterators, and with them their workers
            if not outcome["ok"] and spec.get("may_fail"):
                fresh_frameworks()
    outcome["seconds"] = time.monotonic() - started
    (logs / spec["name"] / f"status-{rank()}.json").write_text(json.dumps(outcome))
    return outcome


def main() -> None:
    plan = json.loads(pathlib.Path(sys.argv[1]).read_text())
    logs = pathlib.Path(plan["logs"])
    for spec in plan["runs"]:
        if spec.get("fresh"):
            fresh_frameworks()
        outcome = run(spec, logs)
        if not outcome["ok"] and not spec.get("may_fail"):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


if __name__ == "__main__":
    main()
