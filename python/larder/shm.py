"""Shared-memory rings: batches written by larderd straight into memory this process maps.

A ring is made over the daemon's Unix socket: the daemon creates an anonymous memfd (no name in
the filesystem), passes its descriptor over this connection only, and keeps the ring as long as
the connection is open. Batches then arrive in the ring's slots. A slot stays this process's
until every numpy array and torch tensor made from its batch is gone (and, with pinned memory,
until the GPU copies queued from it have run); only then may the daemon write the slot again.
Keeping batches alive is safe: when the client holds every slot, the daemon sends the next
batches in the message instead.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import weakref
from typing import List, Optional, Set

import numpy as np

MAGIC = b"LARDRING"
_VERSION = 1
_REPLY = struct.Struct("<IIQQQII16s")  # status, message length, size, header, slot bytes, slots, 0, token
_STATES_AT = 64
_CLIENT_NEXT_AT = 40
# Reply status -> gRPC status code name.
_CODES = {1: "INVALID_ARGUMENT", 2: "RESOURCE_EXHAUSTED", 3: "INTERNAL"}


class RingRefused(Exception):
    """The daemon did not make the ring; `code` is the gRPC status code name."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class Ring:
    """A ring of `slots` slots of at least `slot_bytes` each, made by the daemon at Unix socket
    `path` for this process."""

    def __init__(self, path: str, slots: int, slot_bytes: int):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            sock.sendall(MAGIC + struct.pack("<IIQ", _VERSION, slots, slot_bytes))
            data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            while len(data) < _REPLY.size:
                more = sock.recv(4096)
                if not more:
                    raise ConnectionError("larderd closed the ring connection")
                data += more
            status, msg_len, size, header, slot_bytes, slots, _, token = _REPLY.unpack_from(data)
            while len(data) < _REPLY.size + msg_len:
                data += sock.recv(4096)
            if status != 0:
                for fd in fds:
                    os.close(fd)
                msg = data[_REPLY.size : _REPLY.size + msg_len].decode(errors="replace")
                raise RingRefused(msg, _CODES.get(status, "UNKNOWN"))
            if len(fds) != 1:
                raise ConnectionError("larderd sent no ring descriptor")
            try:
                self._mm = mmap.mmap(fds[0], size)
            finally:
                os.close(fds[0])
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.token: bytes = token
        self.size: int = size
        self.header: int = header
        self.slots: int = slots
        self.slot_bytes: int = slot_bytes
        # Every array over the mapping is a view of this one: it goes only after the last of
        # them, and the CUDA registration of a pinned ring is undone as it goes, while the
        # memory is still mapped (numpy clears an array's weak references before releasing
        # its base, the mmap).
        self._all = np.frombuffer(self._mm, np.uint8)
        self._state = self._all[_STATES_AT : _STATES_AT + 4 * slots].view(np.uint32)
        self._next = self._all[_CLIENT_NEXT_AT : _CLIENT_NEXT_AT + 8].view(np.uint64)
        self._held: Set[int] = set()
        self._lock = threading.Lock()
        # Pinned rings: slots released while GPU copies from them may still be queued wait
        # for a CUDA event each.
        self._pinned = False
        self._pending: List[tuple] = []

    @property
    def held(self) -> List[int]:
        """Slots that batches still alive in this process are in."""
        self.poll()
        with self._lock:
            return sorted(self._held | {s for s, _ in self._pending})

    def waiting_for(self, batch: int) -> None:
        """Tells the daemon the stream's next batch is `batch`: when this process holds every
        slot, that batch comes in the message rather than waiting for a slot."""
        self._next[0] = batch

    def take(self, slot: int) -> np.ndarray:
        """The bytes of `slot` as a uint8 array; every array made from it keeps the slot this
        process's until the last of them is gone."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in the ring ({self.slots} slots)")
        self.poll()
        at = self.header + slot * self.slot_bytes
        # Through a memoryview: arrays made from `base` then name it as their base (numpy would
        # skip a plain view of `_all` and name `_all`, and the slot would be freed at once).
        base = np.frombuffer(memoryview(self._all[at : at + self.slot_bytes]), np.uint8)
        with self._lock:
            self._held.add(slot)
        weakref.finalize(base, self._release, slot)
        return base

    def _release(self, slot: int) -> None:
        if self._pinned:
            import torch

            event = torch.cuda.Event()
            event.record()
            with self._lock:
                self._held.discard(slot)
                self._pending.append((slot, event))
            return
        with self._lock:
            self._held.discard(slot)
        self._state[slot] = 0  # one aligned 4-byte store: the daemon may write the slot again

    def poll(self) -> None:
        """Frees the pinned slots whose GPU copies have run."""
        if not self._pending:
            return
        with self._lock:
            ready = [e.query() for _, e in self._pending]
            done = [p for p, r in zip(self._pending, ready) if r]
            self._pending = [p for p, r in zip(self._pending, ready) if not r]
        for s, _ in done:
            self._state[s] = 0

    def pin(self) -> bool:
        """Registers the ring with CUDA as pinned memory, so `tensor.to("cuda", non_blocking=True)`
        copies straight from the slot, asynchronously. False when no GPU is present.

        A slot is handed back once the CUDA work queued before its last array went away has run,
        on the stream current then: copies from it belong on that stream (the loop's current
        stream, as a plain `.to("cuda", non_blocking=True)` in the loop does). The daemon writes a
        freed slot again soon after (the lowest free slot is taken first)."""
        import torch

        if self._pinned:
            return True
        if not torch.cuda.is_available():
            return False
        ptr = self._all.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the ring failed: CUDA error {int(err)} ({err})")
        # Unregistered before the mapping goes: a registration outliving it would keep the
        # memfd's pages locked and refuse the next ring mapped at the same address.
        weakref.finalize(self._all, _unregister, ptr)
        self._pinned = True
        return True

    def close(self) -> None:
        """Gives the ring back: the daemon frees its side now; this process's mapping goes when
        the last batch from it does."""
        self._sock.close()

    @property
    def closed(self) -> bool:
        """Given back, or gone with the daemon that made it (a daemon restarted, by an upgrade
        say, knows none of the rings before it): its connection closed at the other end."""
        if self._sock.fileno() < 0:
            return True
        try:
            gone = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            self._sock.close()
        return gone


def _unregister(ptr: int) -> None:
    try:
        import torch

        # Copies queued from the last slots freed may not have run yet (their events were
        # pending with the ring): they finish before the memory stops being pinned and mapped.
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # CUDA already torn down at exit: the process's registrations go with it
        pass


def open_ring(path: str, slots: int, slot_bytes: int) -> Optional[Ring]:
    """A ring, or None where this platform has no memfd passing (not Linux)."""
    if not hasattr(socket, "recv_fds") or not hasattr(socket, "AF_UNIX"):
        return None
    return Ring(path, slots, slot_bytes)
