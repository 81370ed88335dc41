"""The client's one exception, and what it says when no daemon answers."""

from __future__ import annotations

import socket
from typing import Optional, Tuple

import grpc


class LarderError(Exception):
    """A request larderd refused or could not serve; the message says why."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


# What grpcio says when no daemon took the call (no socket, refused, the connection lost).
_TRANSPORT = ("failed to connect", "connection refused", "no such file", "socket closed",
              "connections to all backends failing", "connection reset", "broken pipe", "goaway")


def answered(reached: bool, details: Optional[str]) -> bool:
    """Whether an UNAVAILABLE came from the daemon itself (a dataset being opened, a reader that
    failed, the daemon shutting down: its own words, worth showing as they are) rather than from
    no daemon answering. `reached`: the daemon answered this client before."""
    text = (details or "").lower()
    return reached and not any(t in text for t in _TRANSPORT)


def unreachable(address: str, details: str, node: Optional[Tuple[int, int]] = None) -> str:
    """What to say when no daemon answers at `address`, in words rather than gRPC's; `node`:
    (node, nodes) of a job over several nodes, whose every node needs its own daemon."""
    where = ""
    if node is not None:
        where = (f" This rank is on node {node[0]} of {node[1]} ({socket.gethostname()}): a job over "
                 "several nodes needs a larderd on every node (docs/admin.md, \"Several nodes\").")
    return (
        f"no larder daemon at {address}: is larderd running? (systemctl status larderd; "
        f"set LARDER_ADDR or address= for another address){where} [{details}]"
    )
