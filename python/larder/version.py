"""This client's API version against the daemon's: which side to upgrade when they differ."""

from __future__ import annotations

import warnings
from typing import Optional

import grpc

from larder.errors import LarderError
from larder.v1 import larder_pb2 as pb

# The API this client's stubs were generated with (the proto's ApiVersion).
API_VERSION = pb.API_VERSION_CURRENT
CLIENT_VERSION = "0.1.0"


class LarderVersionWarning(UserWarning):
    """The daemon is older than this client: calls it lacks fail."""


def wheel(version: str) -> str:
    """Where larder's Debian package installs the client wheel of its release."""
    return f"/usr/share/larder/larder_client-{version}-py3-none-any.whl"


def check(info: Optional["pb.DaemonInfo"], address: str) -> None:
    """Raises LarderError when the daemon (`info`: its GetInfo answer, None when it has no
    GetInfo) no longer serves this client's API; warns when the daemon is the older side."""
    ours = API_VERSION
    client = f"this larder-client {CLIENT_VERSION} (API {ours})"
    if info is None:
        warnings.warn(
            f"larderd at {address} is older than {client}: it does not say its API version; calls it "
            "lacks fail with UNIMPLEMENTED. Upgrade larderd, or use the larder-client of its release.",
            LarderVersionWarning, stacklevel=4)
    elif info.min_client_api_version > ours:
        raise LarderError(
            f"{client} is older than larderd {info.version} at {address} serves (API "
            f"{info.min_client_api_version} or newer): upgrade the client (pip install -U "
            f"{wheel(info.version)}, the wheel larder's package puts on the daemon's machine, or "
            f"pip install -U ./python in larder's source)", grpc.StatusCode.FAILED_PRECONDITION)
    elif info.api_version < ours:
        warnings.warn(
            f"larderd {info.version} at {address} speaks API {info.api_version}, older than {client}: "
            f"calls it lacks fail with UNIMPLEMENTED. Upgrade larderd, or install the client of its "
            f"release (pip install {wheel(info.version)} on the daemon's machine).",
            LarderVersionWarning, stacklevel=4)


def unimplemented(address: str, details: str) -> str:
    """What to say when the daemon does not know a call this client makes."""
    return (f"larderd at {address} does not answer this call: it is older than this larder-client "
            f"{CLIENT_VERSION} (API {API_VERSION}); upgrade larderd [{details}]")
