"""The daemon's addresses: the default, and what gRPC and the shared-memory rings make of one."""

from __future__ import annotations

from typing import Optional

# The daemon's Unix socket under its systemd unit: where it knows who is asking, and where
# batches come in shared memory. $LARDER_ADDR or `address=` for another ("host:port" for TCP).
DEFAULT_ADDRESS = "unix:/run/larder/larder.sock"


def grpc_target(address: str) -> str:
    """grpc target for "host:port", "http://host:port" or "unix:/path"."""
    for scheme in ("http://", "https://"):
        if address.startswith(scheme):
            return address[len(scheme):].rstrip("/")
    return address


def unix_path(address: str) -> Optional[str]:
    """The socket path of a "unix:" address, else None."""
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if address.startswith("unix:"):
        return address[len("unix:"):]
    return None
