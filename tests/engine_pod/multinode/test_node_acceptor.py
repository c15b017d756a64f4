"""The leader's join (executor/node_acceptor.py): each connection's handshake
on its own thread, so stalled peers cannot hold a real node back; a bound on
handshakes in progress; the first authenticated connection per node rank
wins; the deadline and the stop event end the wait. Pure: loopback sockets
and threads, no engine."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from engine_pod.config import NodeLayout
from engine_pod.distributed.join_stop import JoinStopped
from engine_pod.distributed.node_channel import (
    HANDSHAKE_TIMEOUT_SECONDS,
    MAGIC,
    NONCE_BYTES,
    ChannelError,
    connect_to_leader,
    listen,
)
from engine_pod.executor.node_acceptor import MAX_HANDSHAKES, JoinTimeout, NodeAcceptor
from tests.engine_pod.multinode.refusing_leader import refusing

KEY = b"k" * 32
GREETING = len(MAGIC) + NONCE_BYTES


class _Leader:
    """A NodeAcceptor running on a thread, as the leader's start-up runs it."""

    def __init__(self, nnodes: int = 2, join_timeout_s: float = 30.0, max_handshakes: int = MAX_HANDSHAKES) -> None:
        self.listener = listen(0)
        self.port = self.listener.getsockname()[1]
        # The node channel listens on master_port + 1.
        layout = NodeLayout(nnodes, 0, "127.0.0.1", self.port - 1, join_timeout_s=join_timeout_s)
        self.acceptor = NodeAcceptor(self.listener, KEY, layout, max_handshakes)
        self.joined: list[tuple[int, object, float]] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.acceptor.run(lambda rank, channel, peer: self.joined.append((rank, channel, time.monotonic())),
                              lambda: None, self.stop)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e
        finally:
            self.listener.close()

    def node(self, node_rank: int = 1, timeout: float = 10.0):
        return connect_to_leader(("127.0.0.1", self.port), node_rank, KEY, time.monotonic() + timeout)

    def stalled_peer(self) -> socket.socket:
        """Connects and sends nothing."""
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for _, channel, _ in self.joined:
            channel.close()


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """What the leader sends until it closes the connection (or the timeout passes)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(1024):
            data += chunk
    except TimeoutError:
        data += b"<still open>"
    return data


def test_a_stalled_peer_does_not_delay_a_real_node():
    leader = _Leader()
    try:
        stalled = leader.stalled_peer()
        assert stalled.recv(GREETING).startswith(MAGIC)  # its handshake is under way, and stalls
        start = time.monotonic()
        channel = leader.node()
        leader.thread.join(5)
        elapsed = time.monotonic() - start
        assert leader.error is None and [rank for rank, _, _ in leader.joined] == [1]
        assert elapsed < 1.0 < HANDSHAKE_TIMEOUT_SECONDS, f"the node joined after {elapsed:.1f}s"
        # The join is over: the stalled handshake is cut off at once, not at its timeout.
        cut_at = time.monotonic()
        assert _read_all(stalled, timeout=3) == b""
        assert time.monotonic() - cut_at < 1.0
        channel.close()
    finally:
        leader.close()


def test_many_stalled_peers_beyond_the_bound_are_closed_at_once(caplog):
    caplog.set_level(logging.WARNING, logger="engine_pod.executor.node_acceptor")
    leader = _Leader(max_handshakes=4)
    stalled = []
    try:
        for _ in range(4):
            stalled.append(leader.stalled_peer())
            assert stalled[-1].recv(GREETING).startswith(MAGIC)
        extra = [leader.stalled_peer() for _ in range(6)]
        start = time.monotonic()
        for sock in extra:
            assert _read_all(sock, timeout=3) == b"", "a peer beyond the bound was greeted or kept open"
        assert time.monotonic() - start < 2.0
        assert sum("handshakes already in progress" in r.getMessage() for r in caplog.records) == 6
        # Peers that go away free their slots: a real node then joins at once.
        for sock in stalled:
            sock.close()
        channel = leader.node()
        leader.thread.join(5)
        assert leader.error is None and [rank for rank, _, _ in leader.joined] == [1]
        channel.close()
    finally:
        for sock in stalled + extra:
            sock.close()
        leader.close()


def test_the_first_authenticated_connection_per_rank_wins(caplog):
    caplog.set_level(logging.WARNING, logger="engine_pod.executor.node_acceptor")
    leader = _Leader(nnodes=3)
    try:
        first = leader.node(1)
        deadline = time.monotonic() + 5
        while not leader.joined and time.monotonic() < deadline:
            time.sleep(0.02)
        second = leader.node(1)   # a second node claiming rank 1: authenticated, then dropped
        stranger = leader.node(7)  # a rank outside the group
        for dropped in (second, stranger):
            with pytest.raises(ChannelError):
                dropped.recv_payload()
        last = leader.node(2)
        leader.thread.join(5)
        assert leader.error is None and [rank for rank, _, _ in leader.joined] == [1, 2]
        messages = [r.getMessage() for r in caplog.records]
        assert any("node rank 1 is already joined" in m for m in messages)
        assert any("node rank 7 is out of range" in m for m in messages)
        for channel in (first, last):
            channel.close()
    finally:
        leader.close()


def test_a_peer_failing_the_handshake_is_dropped_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="engine_pod.executor.node_acceptor")
    leader = _Leader()
    try:
        with pytest.raises(ChannelError, match="refused this node"):
            connect_to_leader(("127.0.0.1", leader.port), 1, b"o" * 32, time.monotonic() + 5)
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any("dropped a connection" in r.getMessage() and "failed authentication" in r.getMessage()
                   for r in caplog.records)
        channel = leader.node()  # the legitimate node still joins
        leader.thread.join(5)
        assert [rank for rank, _, _ in leader.joined] == [1]
        channel.close()
    finally:
        leader.close()


def test_the_deadline_names_the_missing_nodes_and_where_they_dial():
    leader = _Leader(nnodes=3, join_timeout_s=1.0)
    stalled = leader.stalled_peer()
    try:
        leader.thread.join(5)
        assert isinstance(leader.error, JoinTimeout)
        assert str(leader.error) == f"nodes [1, 2] did not join within 1s (they dial 127.0.0.1:{leader.port})"
        assert _read_all(stalled, timeout=3).startswith(MAGIC)  # greeted, then cut off when the join ended
    finally:
        stalled.close()
        leader.close()


def test_the_stop_event_ends_the_wait_at_once():
    leader = _Leader()
    stalled = leader.stalled_peer()
    try:
        stalled.recv(GREETING)
        start = time.monotonic()
        leader.stop.set()
        leader.thread.join(5)
        assert isinstance(leader.error, JoinStopped) and "nodes [1]" in str(leader.error)
        assert time.monotonic() - start < 1.0
        assert _read_all(stalled, timeout=3) == b""
    finally:
        stalled.close()
        leader.close()


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_handshakes must be >= 1"):
        NodeAcceptor(socket.socket(), KEY, NodeLayout(2, 0, "127.0.0.1"), max_handshakes=0)


def test_a_node_dials_again_after_a_leader_that_closed_before_its_greeting_and_stops_on_request():
    """A leader with every handshake slot taken closes the connection at once: the node dials again
    (until its deadline) rather than giving up; its stop event ends that wait."""
    listener = listen(0)
    port = listener.getsockname()[1]
    with refusing(listener) as attempts:
        node_stop = threading.Event()
        threading.Timer(1.0, node_stop.set).start()
        start = time.monotonic()
        with pytest.raises(JoinStopped, match=f"waiting for the leader at 127.0.0.1:{port}"):
            connect_to_leader(("127.0.0.1", port), 1, KEY, time.monotonic() + 30, node_stop)
        assert time.monotonic() - start < 2.0
        assert len(attempts) >= 3
        with pytest.raises(ChannelError, match="closed the connection before its greeting"):
            connect_to_leader(("127.0.0.1", port), 1, KEY, time.monotonic() + 0.5)
