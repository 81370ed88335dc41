"""The client's one exception, and what it says when no daemon answers."""

from __future__ import annotations

from typing import Optional

import grpc


class LarderError(Exception):
    """A request larderd refused or could not serve; the message says why."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


def unreachable(address: str, details: str) -> str:
    """What to say when no daemon answers at `address`, in words rather than gRPC's."""
    return (
        f"no larder daemon at {address}: is larderd running? (systemctl status larderd; "
        f"set LARDER_ADDR or address= for another address) [{details}]"
    )
