"""The daemon connections datasets open, one per process: a forked DataLoader worker makes its
own and leaves the one it inherited alone (gRPC is not fork-safe), each process closes its own
before the interpreter exits, and a process that must fork later asks the daemon through a
short-lived process."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import weakref
from typing import List, Optional

from larder.client import Client
from larder.errors import LarderError

# Connections a forked worker inherited from its parent, kept from being closed in the child.
_INHERITED: List[Client] = []
# The connections datasets opened, each with the pid of the process that opened it, closed
# before the interpreter exits (a gRPC channel left to the interpreter's last moments can abort
# the process as its threads go).
_OPENED: "weakref.WeakKeyDictionary[Client, int]" = weakref.WeakKeyDictionary()


@atexit.register
def _close_opened() -> None:
    for client, pid in list(_OPENED.items()):
        if pid == os.getpid():
            try:
                client.close()
            except Exception:
                pass


def open_client(address: Optional[str], reconnect_timeout: float) -> Client:
    """A connection for this process, closed before the interpreter exits (in this process
    only: a forked child that inherits it leaves it alone)."""
    client = Client(address, reconnect_timeout)
    _OPENED[client] = os.getpid()
    return client


def inherited(client: Client) -> None:
    """Keeps `client`, inherited through fork, from being closed (or collected) in this
    process: its channel is the parent's, never used or closed here."""
    _INHERITED.append(client)


def plan_elsewhere(address: Optional[str], timeout: float, dataset: str, batch_size: int, shard: dict) -> int:
    """Batches a stream would serve, asked by a short-lived process: the training process asks
    for len() (Lightning does) before it forks DataLoader workers, and a process that has used
    gRPC cannot fork safely (a worker's new connection can hang for good)."""
    code = (
        "import json, sys; from larder import Client, LarderError; a = json.loads(sys.argv[1])\n"
        "try: print(Client(a['address'], a['timeout']).plan(a['dataset'], a['batch_size'], **a['shard']).num_batches)\n"
        "except LarderError as e: sys.exit(str(e))"
    )
    arg = json.dumps({"address": address, "timeout": timeout, "dataset": dataset,
                      "batch_size": batch_size, "shard": shard})
    # The folder that holds this package, for the child to import it from.
    path = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
    try:
        out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, env=env,
                             timeout=60 + 2 * timeout)
    except subprocess.TimeoutExpired:
        raise LarderError(f"len(): the daemon at {address} did not answer in {60 + 2 * timeout:.0f} s")
    if out.returncode != 0:
        raise LarderError(out.stderr.strip() or f"len() failed (exit status {out.returncode})")
    return int(out.stdout)
