"""The fast data path of the direct P/D channel: a decode pod's KV inbox socket.

gRPC moves a push's bytes at a fraction of what a plain TCP stream does on
the same host (docs/benchmarks.md, "P/D"), so a decode pod started with
``--kv-inbox-port`` also listens there, and the gRPC call stays the control
path: ``OpenKVInbox`` (authenticated like every internal call) hands a
prefill pod a one-time ticket, the prefill pod opens one connection with it
and streams the request's signed blocks as frames, and the decode pod
answers how many it took. Under mutual TLS the socket speaks TLS with the
pod's own certificates; every value is still verified (MAC, header) when
read, as the gRPC path's and Redis's are.

Wire format (integers big-endian):

    hello   MAGIC (8 bytes), ticket (32 bytes)
    reply   to the hello: go ahead (status 0) or refused (status 1, and why)
    block   0x01, block hash (32 bytes), value length (4 bytes), value
    end     0x00
    reply   status (1 byte: 0 taken, 1 refused), blocks taken (4 bytes),
            message length (2 bytes), message (UTF-8)

The reply to the hello lets a sender learn of a refused ticket before it
sends a block (a refusal mid-stream may reach it as a reset connection).

A receiver never trusts a length: a value must be exactly the model's value
size, or the push is refused before one byte of it is read. No connection
outlives its deadlines: ``idle_timeout_s`` between reads, ``max_transfer_s``
in all, and at most ``max_connections`` are served at once (one more waits
``slot_wait_s`` for a slot, the rest queue in the kernel's backlog).
"""

from __future__ import annotations

import logging
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAGIC = b"TSRKVIN1"
TICKET_BYTES = 32
HASH_BYTES = 32
_BLOCK, _END = b"\x01", b"\x00"
_VALUE_LENGTH = struct.Struct("!I")
_REPLY = struct.Struct("!BIH")
# Blocks handed to the store at once: fewer lock round trips, little held back.
_RECEIVE_BATCH = 16
# A pod network connects in milliseconds: longer means a port a policy drops, so
# the sender soon pushes another way instead of spending its whole deadline.
CONNECT_TIMEOUT_S = 5.0

Receive = Callable[[list[tuple[bytes, bytes]]], None]


class InboxRefused(Exception):
    """The decode pod refused the push (a bad ticket, a value of another size, a store error)."""


class InboxUnreachable(ConnectionError):
    """No connection (or TLS handshake) to the inbox socket: no block was sent, the caller may push another way."""


class InboxBusy(Exception):
    """Too many tickets are outstanding: the caller pushes another way."""


@dataclass(frozen=True)
class InboxConfig:
    """Limits of a decode pod's inbox, on its socket and on the gRPC push alike."""

    hello_timeout_s: float = 5.0
    """A connection must finish its TLS handshake and present its ticket this soon (a sender does at
    once): one that reaches the port without a ticket holds a slot no longer."""
    idle_timeout_s: float = 60.0
    """A push with nothing to read for this long is dropped (a stalled or dead prefill pod)."""
    max_transfer_s: float = 600.0
    """No push is served longer than this in all, however steadily it trickles."""
    ticket_ttl_s: float = 30.0
    """A ticket not used within this long is void."""
    max_tickets: int = 4096
    """Tickets outstanding at most (a caller beyond gets InboxBusy, then pushes over gRPC)."""
    max_connections: int = 64
    """Connections served at once; one more waits for a slot (below), then is closed."""
    slot_wait_s: float = 5.0
    """How long a connection beyond max_connections waits for another to end."""


class InboxSocket:
    """Listens on ``address`` for pushes and hands their blocks to ``receive``
    (the tiered store's: it checks hash and value sizes, MACs are checked on read)."""

    def __init__(self, receive: Receive, value_bytes: int, address: tuple[str, int],
                 tls: ssl.SSLContext | None = None, config: InboxConfig = InboxConfig()) -> None:
        self._receive = receive
        self._value_bytes = value_bytes
        self._tls = tls
        self.config = config
        self._tickets: dict[bytes, tuple[str, float]] = {}  # ticket -> (transfer id, void after)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(config.max_connections)
        self._closed = threading.Event()
        try:
            self._listener = socket.create_server(address, family=_family(address[0]), backlog=64)
        except OSError as e:
            raise ValueError(f"--kv-inbox-port: cannot listen on {address[0]}:{address[1]}: "
                             f"{e.strerror or e}") from None
        self.port: int = self._listener.getsockname()[1]
        self.connections_refused = 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-inbox-{self.port}", daemon=True)
        self._thread.start()

    def issue_ticket(self, transfer_id: str) -> bytes:
        """A ticket for one connection, void after ``ticket_ttl_s``."""
        now = time.monotonic()
        with self._lock:
            for ticket in [t for t, (_, void_after) in self._tickets.items() if void_after < now]:
                del self._tickets[ticket]
            if len(self._tickets) >= self.config.max_tickets:
                raise InboxBusy(f"{len(self._tickets)} inbox tickets outstanding")
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._tickets[ticket] = (transfer_id, now + self.config.ticket_ttl_s)
        return ticket

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept; a close alone does not (Linux)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)

    # -- serving -------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            # Waiting here holds back later accepts too: the kernel's backlog queues them.
            if not self._slots.acquire(timeout=self.config.slot_wait_s):
                self.connections_refused += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-inbox-conn", daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _Deadline(self.config.hello_timeout_s, self.config.hello_timeout_s)
            if self._tls is not None:
                raw.settimeout(hello.next_wait())
                conn = self._tls.wrap_socket(raw, server_side=True)
            self._answer(conn, hello)
        except (OSError, TimeoutError) as e:  # the peer went away, stalled or failed the handshake
            logger.info("kv inbox connection dropped: %s", e)
        except Exception:  # a bug: this connection ends, the listener serves on
            logger.exception("kv inbox connection failed")
        finally:
            conn.close()
            raw.close()
            self._slots.release()

    def _answer(self, conn: socket.socket, hello: _Deadline) -> None:
        taken = 0
        deadline = hello
        try:
            transfer_id = self._redeem(_recv_exact(conn, len(MAGIC) + TICKET_BYTES, hello))
            conn.settimeout(hello.next_wait())
            _send_reply(conn, 0, None)  # go ahead
            deadline = _Deadline(self.config.max_transfer_s, self.config.idle_timeout_s)
            taken = self._take_blocks(conn, deadline)
        except InboxRefused as e:
            logger.warning("kv inbox push refused: %s", e)
            conn.settimeout(deadline.next_wait())
            _send_reply(conn, taken, str(e))
            return
        conn.settimeout(deadline.next_wait())
        _send_reply(conn, taken, None)
        logger.debug("kv inbox took %d blocks of %s", taken, transfer_id)

    def _redeem(self, hello: bytearray) -> str:
        if hello[: len(MAGIC)] != MAGIC:
            raise InboxRefused("not a KV inbox push (bad magic)")
        with self._lock:
            entry = self._tickets.pop(bytes(hello[len(MAGIC):]), None)
        if entry is None or entry[1] < time.monotonic():
            raise InboxRefused("unknown, used or expired ticket")
        return entry[0]

    def _take_blocks(self, conn: socket.socket, deadline: _Deadline) -> int:
        taken, batch = 0, []
        while True:
            kind = _recv_exact(conn, 1, deadline)
            if kind == _END:
                break
            if kind != _BLOCK:
                raise InboxRefused(f"unknown frame kind {kind.hex()}")
            header = _recv_exact(conn, HASH_BYTES + _VALUE_LENGTH.size, deadline)
            (length,) = _VALUE_LENGTH.unpack_from(header, HASH_BYTES)
            if length != self._value_bytes:
                raise InboxRefused(f"a KV value of this model is {self._value_bytes} bytes, got {length}")
            batch.append((bytes(header[:HASH_BYTES]), bytes(_recv_exact(conn, length, deadline))))
            if len(batch) >= _RECEIVE_BATCH:
                taken += self._hand_over(batch)
                batch = []
        return taken + self._hand_over(batch)

    def _hand_over(self, batch: list[tuple[bytes, bytes]]) -> int:
        try:
            self._receive(batch)
        except ValueError as e:
            raise InboxRefused(str(e)) from None
        return len(batch)


# -- the sending side -----------------------------------------------------------
def push_blocks(host: str, port: int, ticket: bytes, blocks: Iterable[tuple[bytes, bytes]], timeout_s: float,
                tls: ssl.SSLContext | None = None, server_name: str | None = None) -> int:
    """Stream signed blocks to a decode pod's inbox socket; the number it took
    (every block sent, or InboxRefused). InboxUnreachable when no connection
    was made (nothing sent); OSError/TimeoutError when the pod goes away or
    the whole push outlasts ``timeout_s``."""
    deadline = _Deadline(timeout_s, timeout_s)
    conn = _connect(host, port, tls, server_name, deadline)
    with conn:
        _send(conn, deadline, MAGIC, ticket)
        _read_reply(conn, deadline)
        for block_hash, value in blocks:
            _send(conn, deadline, _BLOCK, block_hash, _VALUE_LENGTH.pack(len(value)), value)
        _send(conn, deadline, _END)
        return _read_reply(conn, deadline)


def _read_reply(conn: socket.socket, deadline: _Deadline) -> int:
    """The blocks the pod took; InboxRefused with its reason if it refused."""
    status, taken, length = _REPLY.unpack(_recv_exact(conn, _REPLY.size, deadline))
    message = bytes(_recv_exact(conn, length, deadline)).decode(errors="replace") if length else ""
    if status != 0:
        raise InboxRefused(message or "refused")
    return int(taken)


def _connect(host: str, port: int, tls: ssl.SSLContext | None, server_name: str | None,
             deadline: _Deadline) -> socket.socket:
    try:
        raw = socket.create_connection((host, port), timeout=min(deadline.next_wait(), CONNECT_TIMEOUT_S))
    except OSError as e:
        raise InboxUnreachable(f"cannot connect to {host}:{port}: {e}") from None
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return tls.wrap_socket(raw, server_hostname=server_name or host) if tls is not None else raw
    except OSError as e:
        raw.close()
        raise InboxUnreachable(f"TLS handshake with {host}:{port} failed: {e}") from None


# -- shared framing ------------------------------------------------------------
class _Deadline:
    """An overall deadline, and the wait allowed for the next socket operation."""

    def __init__(self, total_s: float, idle_s: float) -> None:
        self._end = time.monotonic() + total_s
        self._idle_s = idle_s

    def next_wait(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the push ran past its deadline")
        return min(left, self._idle_s)


def _recv_exact(conn: socket.socket, n: int, deadline: _Deadline) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        conn.settimeout(deadline.next_wait())
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the peer closed the connection ({got} of {n} bytes read)")
        got += k
    return buf


def _send(conn: socket.socket, deadline: _Deadline, *parts: bytes) -> None:
    conn.settimeout(deadline.next_wait())
    # One write per frame: small headers are not sent as packets of their own.
    conn.sendall(b"".join(parts))


def _send_reply(conn: socket.socket, taken: int, error: str | None) -> None:
    message = (error or "").encode()[:1024]
    conn.sendall(_REPLY.pack(0 if error is None else 1, taken, len(message)) + message)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
