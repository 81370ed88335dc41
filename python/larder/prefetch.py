"""Reading a stream ahead: a background thread keeps the next batches ready for the loop, and
stops (cancelling the call) when the loop lets go of the stream."""

from __future__ import annotations

import queue
import threading
from typing import Iterator


class StreamState:
    """What the consumer of a stream shares with the thread that reads it."""

    def __init__(self, prefetch: int = 2):
        self.prefetch = prefetch
        self.call = None
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        call = self.call
        if call is not None:
            call.cancel()


_DONE = object()


def read_ahead(batches: Iterator, depth: int, state: StreamState) -> Iterator:
    """Yields `batches`, read ahead by up to `depth` in a background thread."""
    state.prefetch = depth
    q: "queue.Queue" = queue.Queue(maxsize=depth)

    def put(item) -> bool:
        while not state.stopped:
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def run() -> None:
        try:
            for b in batches:
                if not put((None, b)):
                    return
                del b
            put((None, _DONE))
        except BaseException as e:  # handed to the consumer
            put((e, None))
        finally:
            batches.close()

    thread = threading.Thread(target=run, name="larder-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            err, item = q.get()
            if err is not None:
                raise err
            if item is _DONE:
                return
            yield item
            item = None
    finally:
        state.stop()
        while thread.is_alive():
            try:
                q.get(timeout=0.05)  # let the reader go, and the slots of unread batches
            except queue.Empty:
                pass
        thread.join()
