"""What one user of a shared daemon does, run as that user by test_tenancy.py and
benches/tenancy.py (`setpriv ... python tenants.py MODE ARGS`): the attacks one user may try on
the others, and the epoch another measures meanwhile. Each mode prints one JSON line."""

import json
import os
import signal
import socket
import sys
import threading
import time

import larder
from larder.shm import Ring, RingRefused

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def connections(path: str, n: int, hold: float) -> dict:
    """Opens `n` connections that send only the HTTP/2 preface, and holds them `hold` seconds:
    how many were open after 2 seconds, and at the end."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 64), hard))
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            s.sendall(PREFACE)
            socks.append(s)
        except OSError:
            s.close()

    def open_now():
        alive = 0
        for s in socks:
            try:
                s.setblocking(False)
                got = s.recv(65536)
                alive += got != b""  # data (the server's SETTINGS) or ...
            except BlockingIOError:
                alive += 1  # ... nothing yet: still open
            except OSError:
                pass
        return alive

    time.sleep(2)
    early = open_now()
    time.sleep(max(0.0, hold - 2))
    late = open_now()
    return {"made": len(socks), "open_after_2s": early, "open_at_end": late}


def plans(path: str, dataset: str, seconds: float, threads: int = 8) -> dict:
    """PlanStream at batch size 1, from `threads` threads for `seconds`: answers and refusals."""
    done = {"ok": 0, "refused": 0, "why": ""}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def flood():
        with larder.Client(f"unix:{path}") as c:
            seed = 0
            while time.monotonic() < end:
                seed += 1
                try:
                    c.plan(dataset, 1, seed=seed)
                    with lock:
                        done["ok"] += 1
                except larder.LarderError as e:
                    with lock:
                        done["refused"] += 1
                        done["why"] = str(e)[:300]

    ts = [threading.Thread(target=flood) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return done


def ring(path: str, total_bytes: int) -> dict:
    """Asks for a ring of `total_bytes` (four slots): granted, or why not."""
    try:
        r = Ring(path, 4, total_bytes // 4)
        r.close()
        return {"granted": True}
    except RingRefused as e:
        return {"granted": False, "why": str(e)}


def my_readers() -> list:
    """This user's larderd processes (their readers)."""
    me = os.getuid()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != me:
                continue
            if b"larder-child" in open(f"/proc/{pid}/cmdline", "rb").read():
                out.append(int(pid))
        except OSError:
            pass
    return out


def stop_readers(seconds: float) -> dict:
    """Stops this user's readers, lets them go on a moment, stops them again, for `seconds`."""
    end, stops = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        pids = my_readers()
        for p in pids:
            try:
                os.kill(p, signal.SIGSTOP)
                stops += 1
            except OSError:
                pass
        time.sleep(0.5)
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass
        time.sleep(0.05)
    for p in my_readers():
        try:
            os.kill(p, signal.SIGCONT)
        except OSError:
            pass
    return {"stops": stops}


def epochs(path: str, seconds: float, datasets: list) -> dict:
    """Streams epochs of `datasets` in turn, each with a new seed, for `seconds`; errors (a
    stopped reader ends a stream) are counted and the next epoch goes on."""
    end, done, failed, seed = time.monotonic() + seconds, 0, 0, 0
    with larder.Client(f"unix:{path}") as c:
        while time.monotonic() < end:
            for name in datasets:
                seed += 1
                try:
                    for _ in c.stream(name, 16, seed=seed, transport="bytes"):
                        if time.monotonic() > end:
                            break
                    done += 1
                except larder.LarderError:
                    failed += 1
    return {"epochs": done, "failed": failed}


def epoch(path: str, dataset: str) -> dict:
    """One epoch of `dataset` (batches of 16): its seconds, its samples and whether each came
    once; then a ring of four 1 MiB slots, granted or not."""
    with larder.Client(f"unix:{path}") as c:
        began, seen = time.monotonic(), []
        for b in c.stream(dataset, 16, seed=7, transport="bytes"):
            seen.extend(int(i) for i in b.sample_ids)
        seconds = time.monotonic() - began
    return {
        "seconds": seconds,
        "samples": len(seen),
        "distinct": len(set(seen)),
        "ring": ring(path, 4 << 20),
    }


def listing(path: str) -> dict:
    """How long `larder datasets` (ListDatasets) takes."""
    began = time.monotonic()
    with larder.Client(f"unix:{path}") as c:
        names = [d.name for d in c.datasets()]
    return {"seconds": time.monotonic() - began, "datasets": len(names)}


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "connections":
        out = connections(args[0], int(args[1]), float(args[2]))
    elif mode == "plans":
        out = plans(args[0], args[1], float(args[2]))
    elif mode == "ring":
        out = ring(args[0], int(args[1]))
    elif mode == "stop":
        out = stop_readers(float(args[0]))
    elif mode == "epochs":
        out = epochs(args[0], float(args[1]), args[2:])
    elif mode == "epoch":
        out = epoch(args[0], args[1])
    elif mode == "list":
        out = listing(args[0])
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(out), flush=True)
