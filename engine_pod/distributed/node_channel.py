"""The engine group's control channel between nodes (pods) of one engine.

An engine whose ranks span ``nnodes`` processes (``--nnodes``): the leader
(node 0: the engine core) listens on ``master_port + 1`` and every other node
dials it once. Over that one TCP connection per node travel the calls the
executor broadcasts (the same WorkerCall objects), and back the replies of
that node's ranks. The node relays calls to its local ranks through its own
shared-memory ring, exactly as the leader does to its own.

Authentication (key: ``InternalSecret.derive("engine-group")``, from the
environment like every internal hop, never argv):

    leader -> node   MAGIC, leader nonce (32 bytes)
    node -> leader   MAGIC, node rank (4 bytes), node nonce (32),
                     HMAC(key, "node" | both nonces | node rank)
    leader -> node   HMAC(key, "leader" | both nonces | node rank)

Each side proves it holds the key over the other's fresh nonce (no replay);
a peer that fails is dropped and logged, never with the secret or a MAC. The
session key is HMAC(key, "session" | both nonces | node rank), and every
later frame is

    length (4 bytes), kind (1 byte), HMAC(session key, direction | seq | kind | payload), payload

with a per-direction sequence number, so a frame cannot be forged, replayed,
reordered or reflected; the payload is unpickled only after its MAC checks
out. Frames are integrity-protected, not encrypted (the calls hold token ids
and sampling parameters; the NetworkPolicy keeps other pods off the port).

Liveness: each side sends a heartbeat frame every ``HEARTBEAT_SECONDS`` and
gives the peer up after ``PEER_TIMEOUT_SECONDS`` of silence (a closed
connection is noticed at once), so a lost node fails the group in seconds.
A node's heartbeats also carry its status (its ranks' pipeline-stage figures,
for the leader's metrics), at least once a second even while calls keep the
link busy; the leader keeps the latest one it verified (``NodeLink.peer_status``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import multiprocessing as mp
import pickle
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from engine_pod.distributed.join_stop import JoinStopped

logger = logging.getLogger(__name__)

MAGIC = b"TSRGRP01"
NONCE_BYTES = 32
MAC_BYTES = 32
KEY_PURPOSE = "engine-group"
HEARTBEAT_SECONDS = 1.0
PEER_TIMEOUT_SECONDS = 5.0
# The handshake of one connection must finish this soon (a real node answers at once).
HANDSHAKE_TIMEOUT_SECONDS = 5.0
# A node dials again this soon after a leader that is not listening yet or closed the connection.
DIAL_RETRY_SECONDS = 0.2
# A frame larger than this is refused before it is read (calls are kilobytes; KV loads megabytes).
MAX_FRAME_BYTES = 1 << 30
_FRAME = struct.Struct("!IB")
_RANK = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
_HEARTBEAT, _MESSAGE = 0, 1


def node_channel_port(master_port: int) -> int:
    """The leader's port for the other nodes' control channel: next to the rendezvous store's."""
    return master_port + 1


class ChannelError(ConnectionError):
    """The peer failed authentication, broke the protocol or went away."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class NodeChannel:
    """One authenticated, integrity-protected connection between the leader and a node."""

    def __init__(self, sock: socket.socket, session_key: bytes, is_leader: bool, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._key = session_key
        self._send_label, self._recv_label = (b"L>N", b"N>L") if is_leader else (b"N>L", b"L>N")
        self._send_seq = self._recv_seq = 0
        self._send_lock = threading.Lock()
        self.last_sent = time.monotonic()
        sock.settimeout(PEER_TIMEOUT_SECONDS)

    def send(self, obj: object) -> None:
        self._send_frame(_MESSAGE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def send_heartbeat(self, status: object = None) -> None:
        """A heartbeat, carrying ``status`` (None: nothing) for the peer's NodeLink.peer_status."""
        self._send_frame(_HEARTBEAT, b"" if status is None else pickle.dumps(status, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_frame(self, kind: int, payload: bytes) -> None:
        with self._send_lock:
            mac = _mac(self._key, self._send_label, _SEQ.pack(self._send_seq), bytes([kind]), payload)
            self._send_seq += 1
            try:
                self.sock.sendall(_FRAME.pack(len(payload), kind) + mac + payload)
            except OSError as e:
                raise ChannelError(f"sending to {self.peer} failed: {e}") from None
            self.last_sent = time.monotonic()

    def recv_frame(self) -> tuple[bool, bytes]:
        """The next frame, verified: (whether it is a heartbeat, its payload:
        a message's, or a heartbeat's status, empty for none). Raises
        ChannelError on silence past PEER_TIMEOUT_SECONDS, a closed
        connection or a frame whose MAC does not check out."""
        try:
            length, kind = _FRAME.unpack(_recv_exact(self.sock, _FRAME.size))
            if length > MAX_FRAME_BYTES or kind not in (_HEARTBEAT, _MESSAGE):
                raise ChannelError(f"{self.peer} sent a malformed frame")
            mac = _recv_exact(self.sock, MAC_BYTES)
            payload = _recv_exact(self.sock, length)
        except TimeoutError:
            raise ChannelError(f"{self.peer} sent nothing for {PEER_TIMEOUT_SECONDS:.0f}s") from None
        except ChannelError as e:
            raise ChannelError(f"{self.peer}: {e}") from None
        except OSError as e:
            raise ChannelError(f"{self.peer}: {e}") from None
        expected = _mac(self._key, self._recv_label, _SEQ.pack(self._recv_seq), bytes([kind]), payload)
        if not hmac.compare_digest(mac, expected):
            raise ChannelError(f"{self.peer} sent a frame that failed authentication; dropped")
        self._recv_seq += 1
        return kind == _HEARTBEAT, payload

    def recv_payload(self) -> bytes | None:
        """The next message's verified bytes (None: a heartbeat)."""
        heartbeat, payload = self.recv_frame()
        return None if heartbeat else payload

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class NodeLink:
    """A NodeChannel served by two threads: one reads verified messages into
    ``inbox`` (a pipe, so a caller can wait on it with worker pipes and
    sentinels), one sends heartbeats. When the peer is lost, the inbox gets
    an empty message, ``lost`` says why and ``on_lost`` (if set) is called;
    not after ``close()``."""

    def __init__(self, channel: NodeChannel, on_lost: Callable[[str], None] | None = None,
                 status: Callable[[], object] | None = None) -> None:
        """``status``: what this side's heartbeats carry (a node: its ranks' stage figures)."""
        self.channel = channel
        self.on_lost = on_lost
        self.lost: str | None = None
        self.status = status
        self.peer_status: object = None
        """The latest status the peer's heartbeats carried (verified, then unpickled); None: none yet."""
        self._closing = threading.Event()
        self.inbox, self._inbox_writer = mp.Pipe(duplex=False)
        self._threads = [threading.Thread(target=self._read_loop, name=f"node-link-read-{channel.peer}", daemon=True),
                         threading.Thread(target=self._heartbeat_loop, name=f"node-link-beat-{channel.peer}",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, obj: object) -> None:
        if self.lost is not None:
            raise ChannelError(self.lost)
        self.channel.send(obj)

    def send_last(self, obj: object) -> None:
        """Send the link's last message (the group's shutdown): the peer closing
        the connection after it is then expected, not a lost peer."""
        self._closing.set()
        self.send(obj)

    def receive(self) -> Any:
        """The next message from the inbox (call when it is readable); ChannelError once the peer is lost."""
        try:
            data = self.inbox.recv_bytes()
        except (EOFError, OSError):
            data = b""
        if not data:
            raise ChannelError(self.lost or f"{self.channel.peer}: link closed")
        return pickle.loads(data)

    def _read_loop(self) -> None:
        try:
            while True:
                heartbeat, payload = self.channel.recv_frame()
                if not heartbeat:
                    self._inbox_writer.send_bytes(payload)
                elif payload:
                    self.peer_status = pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - any end of the connection is a lost peer
            self._lose(str(e) if isinstance(e, ChannelError) else f"{self.channel.peer}: {e!r}")

    def _heartbeat_loop(self) -> None:
        last_status = 0.0
        while not self._closing.wait(HEARTBEAT_SECONDS / 4):
            now = time.monotonic()
            # A status goes out every second even while calls keep the link busy (they are no heartbeat).
            with_status = self.status is not None and now - last_status >= HEARTBEAT_SECONDS
            if with_status or now - self.channel.last_sent >= HEARTBEAT_SECONDS:
                try:
                    self.channel.send_heartbeat(self.status() if with_status else None)
                except ChannelError as e:
                    self._lose(str(e))
                    return
                last_status = now if with_status else last_status

    def _lose(self, message: str) -> None:
        if self._closing.is_set() or self.lost is not None:
            return
        self.lost = message
        try:
            self._inbox_writer.send_bytes(b"")
        except OSError:
            pass
        if self.on_lost is not None:
            self.on_lost(message)

    def close(self) -> None:
        self._closing.set()
        self.channel.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2)
        self._inbox_writer.close()
        self.inbox.close()


# -- the handshake -------------------------------------------------------------


def _session(key: bytes, leader_nonce: bytes, node_nonce: bytes, node_rank: int) -> tuple[bytes, bytes, bytes]:
    """(the node's proof, the leader's proof, the session key)."""
    tail = leader_nonce + node_nonce + _RANK.pack(node_rank)
    return _mac(key, b"node", tail), _mac(key, b"leader", tail), _mac(key, b"session", tail)


def accept_node(sock: socket.socket, peer: str, key: bytes) -> tuple[int, NodeChannel]:
    """The leader's side of the handshake on an accepted connection: the
    node's rank and its channel. Raises ChannelError if the peer fails
    authentication (the caller drops it)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
    leader_nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.sendall(MAGIC + leader_nonce)
        hello = _recv_exact(sock, len(MAGIC) + _RANK.size + NONCE_BYTES + MAC_BYTES)
    except (OSError, ChannelError) as e:
        raise ChannelError(f"{peer}: no handshake ({e})") from None
    if hello[: len(MAGIC)] != MAGIC:
        raise ChannelError(f"{peer} does not speak the engine group protocol")
    offset = len(MAGIC)
    (node_rank,) = _RANK.unpack_from(hello, offset)
    node_nonce = hello[offset + _RANK.size : offset + _RANK.size + NONCE_BYTES]
    proof = hello[offset + _RANK.size + NONCE_BYTES :]
    node_proof, leader_proof, session_key = _session(key, leader_nonce, node_nonce, node_rank)
    if not hmac.compare_digest(proof, node_proof):
        raise ChannelError(f"{peer} failed authentication (not holding this deployment's internal secret)")
    try:
        sock.sendall(leader_proof)
    except OSError as e:
        raise ChannelError(f"{peer}: {e}") from None
    return node_rank, NodeChannel(sock, session_key, is_leader=True, peer=f"node {node_rank} ({peer})")


def connect_to_leader(address: tuple[str, int], node_rank: int, key: bytes, deadline: float,
                      stop: threading.Event | None = None) -> NodeChannel:
    """A node's side: dial the leader and authenticate both ways. Until
    ``deadline`` it dials again after a leader that is not listening yet (it
    may start later) or that closes the connection before its greeting (all
    its handshake slots taken, executor/node_acceptor.py). Raises
    JoinStopped once ``stop`` is set while it waits (SIGTERM), ChannelError
    when the leader stays out of reach or the handshake fails."""
    where = f"the leader at {address[0]}:{address[1]}"
    while True:
        if stop is not None and stop.is_set():
            raise JoinStopped(f"asked to stop while waiting for {where}")
        try:
            sock, greeting = _dial(address)
            break
        except (OSError, ChannelError) as e:
            if time.monotonic() >= deadline:
                raise ChannelError(f"cannot reach {where}: {e}") from None
            if stop is not None:
                stop.wait(DIAL_RETRY_SECONDS)
            else:
                time.sleep(DIAL_RETRY_SECONDS)
    try:
        if greeting[: len(MAGIC)] != MAGIC:
            raise ChannelError(f"{where} does not speak the engine group protocol")
        leader_nonce = greeting[len(MAGIC) :]
        node_nonce = secrets.token_bytes(NONCE_BYTES)
        node_proof, leader_proof, session_key = _session(key, leader_nonce, node_nonce, node_rank)
        sock.sendall(MAGIC + _RANK.pack(node_rank) + node_nonce + node_proof)
        try:
            proof = _recv_exact(sock, MAC_BYTES)
        except ChannelError:
            raise ChannelError(f"{where} refused this node (is the internal secret the leader's?)") from None
        if not hmac.compare_digest(proof, leader_proof):
            raise ChannelError(f"{where} failed authentication (not holding this deployment's internal secret)")
    except (OSError, ChannelError) as e:
        sock.close()
        raise ChannelError(str(e) if isinstance(e, ChannelError) else f"{where}: {e}") from None
    return NodeChannel(sock, session_key, is_leader=False, peer="the leader")


def _dial(address: tuple[str, int]) -> tuple[socket.socket, bytes]:
    """A connection to the leader and its greeting (magic and nonce); raises OSError or ChannelError."""
    sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT_SECONDS)
    try:
        return sock, _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    except (OSError, ChannelError) as e:
        sock.close()
        if isinstance(e, ChannelError):
            raise ChannelError("it closed the connection before its greeting") from None
        raise


def listen(port: int) -> socket.socket:
    """The leader's listener for the other nodes (every interface: they are other pods)."""
    try:
        return socket.create_server(("", port), family=socket.AF_INET, backlog=16, reuse_port=False)
    except OSError as e:
        raise ValueError(f"--master-port: cannot listen for the other nodes on port {port}: {e.strerror or e}") \
            from None


__all__ = ["ChannelError", "NodeChannel", "NodeLink", "accept_node", "connect_to_leader", "listen",
           "node_channel_port"]
