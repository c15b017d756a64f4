"""A stand-in leader that accepts each connection and closes it at once, as
one with every handshake slot taken does: tests of a node that keeps dialling."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def refusing(listener: socket.socket) -> Iterator[list[float]]:
    """Serve ``listener`` so, yielding the times of the connections it closed;
    closes the listener on the way out."""
    accepted: list[float] = []
    stop = threading.Event()
    listener.settimeout(0.2)

    def refuse() -> None:
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(time.monotonic())
            sock.close()

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(5)
        listener.close()
