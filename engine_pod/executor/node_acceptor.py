"""The leader's side of an engine group's join: collect the authenticated
links of the other nodes within the join deadline.

Every connection the listener accepts gets its handshake
(node_channel.accept_node) on a thread of its own, so a peer that connects
and then stalls holds only its own thread for the handshake timeout, never
the accept loop: a real node that dials meanwhile is greeted at once.
At most ``MAX_HANDSHAKES`` handshakes run together; a connection beyond that
is closed at once and logged (a flood of stalled peers costs threads, not
memory without bound). The first connection that authenticates for a node
rank wins; a later one for a rank already joined, or a rank outside the
group, is dropped and logged, as is every peer that fails the handshake.

The accept loop runs on the caller's thread and wakes every
``POLL_SECONDS`` to hand over the nodes that joined (``on_joined``, on that
thread, so the caller's own state needs no lock), to check the caller's
liveness (a local rank that died), the join deadline (``JoinTimeout``,
naming the missing nodes and the address they dial) and the stop event
(``JoinStopped``: SIGTERM during start-up, distributed/join_stop.py). When it
returns or raises, the handshakes still running are cut off and a link that
authenticates after the end is closed: nothing outlives the join.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from engine_pod.config import NodeLayout
from engine_pod.distributed.join_stop import JoinStopped
from engine_pod.distributed.node_channel import ChannelError, NodeChannel, accept_node, node_channel_port

logger = logging.getLogger(__name__)

# Handshakes in progress at once; a real group has a handful of nodes, each with one connection.
MAX_HANDSHAKES = 16
# How often the accept loop looks at the deadline, the stop event and the caller's liveness.
POLL_SECONDS = 0.1


class JoinTimeout(Exception):
    """Some nodes did not join within the join timeout; str(e) names them and the address they dial."""


class NodeAcceptor:
    """Collects one authenticated channel from each node 1..nnodes-1 of ``layout`` on ``listener``."""

    def __init__(self, listener: socket.socket, key: bytes, layout: NodeLayout,
                 max_handshakes: int = MAX_HANDSHAKES) -> None:
        if max_handshakes < 1:
            raise ValueError(f"max_handshakes must be >= 1, got {max_handshakes}")
        self.listener = listener
        self.key = key
        self.layout = layout
        self.max_handshakes = max_handshakes
        self._joined: queue.Queue[tuple[int, NodeChannel, str]] = queue.Queue()
        self._lock = threading.Lock()
        self._handshaking: dict[socket.socket, threading.Thread] = {}
        self._closed = False

    def run(self, on_joined: Callable[[int, NodeChannel, str], None], check_alive: Callable[[], None],
            stop: threading.Event) -> None:
        """Until every other node has joined: ``on_joined(node_rank, channel, peer)`` for each, in
        the order they authenticate. Raises JoinTimeout past the layout's join timeout, JoinStopped
        once ``stop`` is set, and whatever ``check_alive`` raises."""
        deadline = time.monotonic() + self.layout.join_timeout_s
        missing = set(range(1, self.layout.nnodes))
        self.listener.settimeout(POLL_SECONDS)
        try:
            while True:
                self._hand_over(missing, on_joined)
                if not missing:
                    return
                if stop.is_set():
                    raise JoinStopped(f"asked to stop while waiting for nodes {sorted(missing)} to join")
                if time.monotonic() >= deadline:
                    raise JoinTimeout(f"nodes {sorted(missing)} did not join within "
                                      f"{self.layout.join_timeout_s:.0f}s (they dial {self.dial_address})")
                check_alive()
                self._accept_one()
        finally:
            self._close()

    @property
    def dial_address(self) -> str:
        """Where the other nodes dial this leader."""
        return f"{self.layout.master_addr}:{node_channel_port(self.layout.master_port)}"

    def _hand_over(self, missing: set[int], on_joined: Callable[[int, NodeChannel, str], None]) -> None:
        """The nodes that authenticated since the last look: the first per rank joins, the rest are dropped."""
        while True:
            try:
                node_rank, channel, peer = self._joined.get_nowait()
            except queue.Empty:
                return
            if node_rank not in missing:
                channel.close()
                logger.warning("engine group: dropped %s: node rank %d is %s", peer, node_rank,
                               "already joined" if 0 < node_rank < self.layout.nnodes else "out of range")
                continue
            missing.discard(node_rank)
            on_joined(node_rank, channel, peer)

    def _accept_one(self) -> None:
        try:
            sock, address = self.listener.accept()
        except TimeoutError:
            return
        peer = f"{address[0]}:{address[1]}"
        with self._lock:
            if len(self._handshaking) >= self.max_handshakes:
                # Logged before the close, so whoever sees the connection end finds the reason logged.
                logger.warning("engine group: dropped a connection from %s: %d handshakes already in progress",
                               peer, self.max_handshakes)
                sock.close()
                return
            thread = threading.Thread(target=self._handshake, args=(sock, peer), daemon=True,
                                      name=f"node-handshake-{peer}")
            self._handshaking[sock] = thread
        thread.start()

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        """On its own thread: authenticate one connection and queue its channel for the accept loop."""
        channel, failure = None, None
        try:
            node_rank, channel = accept_node(sock, peer, self.key)
        except ChannelError as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - any failure drops this peer, never the join
            failure = ChannelError(f"{peer}: {e!r}")
        with self._lock:
            self._handshaking.pop(sock, None)  # its slot is free again
            ended = self._closed
            if channel is not None and not ended:
                self._joined.put((node_rank, channel, peer))
                return
        if channel is not None:
            channel.close()  # authenticated after the join ended
            return
        sock.close()
        if not ended:  # a handshake cut off because the join ended is not the peer's failure
            logger.warning("engine group: dropped a connection: %s", failure)

    def _close(self) -> None:
        """Cut off the handshakes still running and close the links nobody took."""
        with self._lock:
            self._closed = True
            running = dict(self._handshaking)
        for sock in running:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its thread's read; the thread closes it
            except OSError:
                pass
        for thread in running.values():
            thread.join(timeout=1.0)
        while True:
            try:
                _, channel, _ = self._joined.get_nowait()
            except queue.Empty:
                return
            channel.close()


__all__ = ["MAX_HANDSHAKES", "JoinTimeout", "NodeAcceptor"]
