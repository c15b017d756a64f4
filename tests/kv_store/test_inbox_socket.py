"""The direct channel's fast data path: a decode pod's inbox socket on
loopback, a real listener and real connections, fed by ``push_blocks`` and by
the store's sender (its gRPC control call answered by a stand-in pod), with
every way a caller can get it wrong or hold it open."""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from concurrent import futures

import grpc
import pytest

from kv_store.direct_sender import DirectSender, DirectSenderConfig
from kv_store.host_tier import HostMemoryTier
from kv_store.inbox_socket import (
    MAGIC,
    InboxBusy,
    InboxConfig,
    InboxRefused,
    InboxSocket,
    InboxUnreachable,
    push_blocks,
)
from kv_store.tiered_store import TieredKVStore
from tessera.internal_channel import InternalClient, InternalTLS
from tessera.internal_secret import InternalSecret
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.kv_store.blocks import block_hash, genuine_value, make_codec, make_payload
from tests.tls_certs import write_test_certs

SECRET = InternalSecret.from_text("inbox-socket-tests-0123456789abcdef")
SERVER_NAME = "engine.tessera.test"


def _store() -> TieredKVStore:
    return TieredKVStore(make_codec(), HostMemoryTier(0), inbox=HostMemoryTier(1 << 24))


@pytest.fixture
def new_inbox():
    """make(store=None, tls=None, **InboxConfig fields) -> (store, inbox); every inbox closed at the end."""
    made: list[InboxSocket] = []

    def make(store: TieredKVStore | None = None, tls=None, **config) -> tuple[TieredKVStore, InboxSocket]:
        store = store or _store()
        made.append(InboxSocket(store.receive, store.value_bytes, ("127.0.0.1", 0), tls, InboxConfig(**config)))
        return store, made[-1]

    yield make
    for inbox in made:
        inbox.close()


@pytest.fixture
def store_and_inbox(new_inbox):
    return new_inbox()


def _blocks(n: int) -> list[tuple[bytes, bytes]]:
    return [(block_hash(i), genuine_value(i)) for i in range(n)]


def test_a_push_lands_every_block_in_the_inbox_and_serves_reads(store_and_inbox):
    store, inbox = store_and_inbox
    taken = push_blocks("127.0.0.1", inbox.port, inbox.issue_ticket("req-1"), _blocks(40), timeout_s=10)
    assert taken == 40 and store.stats.inbox_received == 40
    got = store.get_blocks([block_hash(i) for i in range(40)])
    assert got == [make_payload(i) for i in range(40)]  # verified on read
    assert store.stats.inbox_hits == 40


def test_a_ticket_opens_one_connection_only(store_and_inbox):
    _, inbox = store_and_inbox
    ticket = inbox.issue_ticket("req")
    assert push_blocks("127.0.0.1", inbox.port, ticket, _blocks(1), timeout_s=10) == 1
    with pytest.raises(InboxRefused, match="unknown, used or expired ticket"):
        push_blocks("127.0.0.1", inbox.port, ticket, _blocks(1), timeout_s=10)


@pytest.mark.parametrize("ticket", [b"\0" * 32, b"guess".ljust(32, b"!")])
def test_a_push_without_an_issued_ticket_is_refused_and_takes_nothing(store_and_inbox, ticket):
    store, inbox = store_and_inbox
    inbox.issue_ticket("someone else's")
    with pytest.raises(InboxRefused, match="unknown, used or expired ticket"):  # before a block is sent
        push_blocks("127.0.0.1", inbox.port, ticket, _blocks(3), timeout_s=10)
    assert store.stats.inbox_received == 0 and len(store.inbox) == 0


def test_a_ticket_expires(new_inbox):
    store, inbox = new_inbox(ticket_ttl_s=0.05)
    ticket = inbox.issue_ticket("late")
    time.sleep(0.2)
    with pytest.raises(InboxRefused, match="expired"):
        push_blocks("127.0.0.1", inbox.port, ticket, _blocks(1), timeout_s=10)


def test_outstanding_tickets_are_bounded(new_inbox):
    store, inbox = new_inbox(max_tickets=3)
    for i in range(3):
        inbox.issue_ticket(f"req-{i}")
    with pytest.raises(InboxBusy):
        inbox.issue_ticket("one too many")


def _raw_push(port: int, *frames: bytes) -> bytes:
    """Send raw bytes after a hello and return whatever the pod answers before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        for frame in frames:
            conn.sendall(frame)
        conn.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
        return out


GO_AHEAD = struct.pack("!BIH", 0, 0, 0)  # the pod's reply to a hello with a good ticket


def _refusal(reply: bytes, after_go_ahead: bool = True) -> str:
    """The reason in the pod's refusal; with a good ticket, a go-ahead comes first."""
    if after_go_ahead:
        assert reply.startswith(GO_AHEAD)
        reply = reply[len(GO_AHEAD):]
    status, _, length = struct.unpack("!BIH", reply[:7])
    assert status == 1
    return reply[7:7 + length].decode()


@pytest.mark.parametrize("length", [0, 1, 2**32 - 1])
def test_a_value_of_another_length_is_refused_before_it_is_read(store_and_inbox, length):
    """A claimed 4 GiB value is refused from its header: nothing is allocated for it."""
    store, inbox = store_and_inbox
    hello = MAGIC + inbox.issue_ticket("req")
    reply = _raw_push(inbox.port, hello, b"\x01" + block_hash(0) + struct.pack("!I", length))
    assert f"a KV value of this model is {store.value_bytes} bytes, got {length}" in _refusal(reply)
    assert len(store.inbox) == 0


def test_bad_magic_and_unknown_frames_are_refused(store_and_inbox):
    _, inbox = store_and_inbox
    assert "bad magic" in _refusal(_raw_push(inbox.port, b"HTTP/1.1" + inbox.issue_ticket("req")), False)
    assert "unknown frame kind 07" in _refusal(_raw_push(inbox.port, MAGIC + inbox.issue_ticket("req"), b"\x07"))


def test_a_stalled_sender_is_dropped_after_the_idle_timeout(new_inbox):
    store, inbox = new_inbox(idle_timeout_s=0.3)
    with socket.create_connection(("127.0.0.1", inbox.port), timeout=10) as conn:
        conn.sendall(MAGIC + inbox.issue_ticket("stall"))
        start = time.monotonic()
        assert conn.recv(len(GO_AHEAD)) == GO_AHEAD
        assert conn.recv(1) == b""  # the pod closed the connection
        assert time.monotonic() - start < 5


def test_a_connection_without_a_ticket_is_dropped_after_the_hello_timeout(new_inbox):
    """Whoever reaches the port but presents no ticket holds a slot for seconds, not the idle minute."""
    _, inbox = new_inbox(hello_timeout_s=0.3, idle_timeout_s=60)
    with socket.create_connection(("127.0.0.1", inbox.port), timeout=10) as conn:
        start = time.monotonic()
        assert conn.recv(1) == b""
        assert time.monotonic() - start < 5


def test_a_trickling_sender_is_dropped_at_the_overall_deadline(new_inbox):
    """One byte every 0.1 s never trips the idle timeout; the overall deadline still ends it."""
    store, inbox = new_inbox(idle_timeout_s=5, max_transfer_s=0.5)
    with socket.create_connection(("127.0.0.1", inbox.port), timeout=10) as conn:
        conn.sendall(MAGIC + inbox.issue_ticket("trickle") + b"\x01")
        start = time.monotonic()
        with pytest.raises(OSError):
            for byte in block_hash(0) * 100:
                conn.sendall(bytes([byte]))
                time.sleep(0.1)
        assert time.monotonic() - start < 5


def test_connections_beyond_the_limit_wait_for_a_slot_then_are_closed(new_inbox):
    store, inbox = new_inbox(max_connections=2, slot_wait_s=0.2)
    held = [socket.create_connection(("127.0.0.1", inbox.port), timeout=10) for _ in range(2)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", inbox.port), timeout=10) as extra:
            assert extra.recv(1) == b""
        assert inbox.connections_refused == 1
    finally:
        for conn in held:
            conn.close()
    # Slots come back once connections end: pushes one after another all get one.
    _, inbox = new_inbox(store, max_connections=1)
    for _ in range(3):
        assert push_blocks("127.0.0.1", inbox.port, inbox.issue_ticket("r"), _blocks(1), timeout_s=10) == 1


def test_a_port_nobody_serves_is_unreachable_before_anything_is_sent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sent = []
    with pytest.raises(InboxUnreachable):
        push_blocks("127.0.0.1", port, b"t" * 32, iter(sent), timeout_s=5)


def test_the_port_already_taken_is_a_clear_error(store_and_inbox):
    store, inbox = store_and_inbox
    with pytest.raises(ValueError, match=f"--kv-inbox-port: cannot listen on 127.0.0.1:{inbox.port}"):
        InboxSocket(store.receive, store.value_bytes, ("127.0.0.1", inbox.port))


# -- mutual TLS --------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return write_test_certs(tmp_path_factory.mktemp("certs"), SERVER_NAME)


def _server_tls(certs) -> ssl.SSLContext:
    from engine_pod.server.auth import ServerTLS

    return ServerTLS(certs["server.crt"], certs["server.key"], certs["ca.crt"]).ssl_context()


def test_under_mutual_tls_a_peer_with_the_deployments_certificate_pushes(certs, new_inbox):
    store, inbox = new_inbox(tls=_server_tls(certs))
    client = InternalTLS(certs["ca.crt"], certs["server.crt"], certs["server.key"], SERVER_NAME).ssl_context()
    taken = push_blocks("127.0.0.1", inbox.port, inbox.issue_ticket("r"), _blocks(5), 10, client, SERVER_NAME)
    assert taken == 5 and len(store.inbox) == 5


@pytest.mark.parametrize("who", ["plaintext", "another CA's certificate", "no certificate"])
def test_under_mutual_tls_anyone_else_gets_no_handshake(certs, who, new_inbox):
    store, inbox = new_inbox(tls=_server_tls(certs))
    ticket = inbox.issue_ticket("r")
    if who == "plaintext":
        with pytest.raises((ConnectionError, InboxRefused, OSError)):
            push_blocks("127.0.0.1", inbox.port, ticket, _blocks(1), timeout_s=5)
    else:
        client = ssl.create_default_context(cafile=certs["ca.crt"])
        if who == "another CA's certificate":
            client.load_cert_chain(certs["rogue.crt"], certs["rogue.key"])
        with pytest.raises(OSError):  # refused at the handshake, or at the first read after it (TLS 1.3)
            push_blocks("127.0.0.1", inbox.port, ticket, _blocks(1), 5, client, SERVER_NAME)
    assert len(store.inbox) == 0


# -- the sender: OpenKVInbox, then the socket --------------------------------------
class _DecodePod(pb_grpc.EngineServicer):
    """Answers OpenKVInbox with a real inbox socket's ticket (or port 0) and
    takes PushKVBlocks, counting which path each push took."""

    def __init__(self, inbox: InboxSocket | None, store: TieredKVStore, port: int | None = None) -> None:
        self.inbox, self.store, self.port = inbox, store, port
        self.grpc_pushes = 0

    def OpenKVInbox(self, request, context):
        if self.inbox is None:
            return pb.OpenKVInboxReply(port=0)
        ticket = self.inbox.issue_ticket(request.transfer_id)
        return pb.OpenKVInboxReply(port=self.port or self.inbox.port, ticket=ticket)

    def PushKVBlocks(self, request_iterator, context):
        self.grpc_pushes += 1
        n = 0
        for message in request_iterator:
            self.store.receive([(b.block_hash, b.value) for b in message.blocks])
            n += len(message.blocks)
        return pb.PushKVBlocksReply(num_blocks=n)


def _serve(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _push_through_sender(servicer, n: int = 6, fallback=None, before_the_rest=lambda: None):
    """Push n blocks to the stand-in pod through a store's sender: the first, then (after
    ``before_the_rest``) the others; its result."""
    server, address = _serve(servicer)
    codec = make_codec()
    sender = DirectSender(codec.sign, fallback, lambda: InternalClient(SECRET), DirectSenderConfig(timeout_s=10))
    try:
        for i in range(n):
            sender.send("req", address, block_hash(i), codec.encode(block_hash(i), make_payload(i)))
            if i == 0:
                before_the_rest()
        return sender.finish("req").result(timeout=20)
    finally:
        sender.close()
        server.stop(None)


def test_the_sender_pushes_over_the_socket_when_the_pod_has_one(new_inbox):
    store, inbox = new_inbox()
    servicer = _DecodePod(inbox, store)
    result = _push_through_sender(servicer)
    assert (result.channel, result.data_path, result.num_blocks, result.error) == ("direct", "socket", 6, None)
    assert servicer.grpc_pushes == 0
    assert store.get_blocks([block_hash(i) for i in range(6)]) == [make_payload(i) for i in range(6)]


def test_the_sender_pushes_over_grpc_to_a_pod_without_a_socket():
    store = _store()
    servicer = _DecodePod(None, store)
    result = _push_through_sender(servicer)
    assert (result.channel, result.data_path, result.num_blocks) == ("direct", "grpc", 6)
    assert servicer.grpc_pushes == 1 and len(store.inbox) == 6


def test_a_socket_port_that_cannot_be_reached_falls_back_to_grpc_not_redis(new_inbox):
    """A NetworkPolicy that drops the inbox port costs one refused connect, not the push."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    store, inbox = new_inbox()
    servicer = _DecodePod(inbox, store, port=closed_port)
    result = _push_through_sender(servicer)
    assert (result.channel, result.data_path, result.num_blocks) == ("direct", "grpc", 6)
    assert servicer.grpc_pushes == 1 and len(store.inbox) == 6


def test_a_refused_socket_push_goes_to_the_fallback():
    """The pod refuses mid-push (here: a value of another model's size): the
    push fails, and the blocks go to Redis (the fallback), never half-used."""
    store = _store()
    inbox = InboxSocket(store.receive, store.value_bytes + 1, ("127.0.0.1", 0))
    landed: list = []
    try:
        result = _push_through_sender(_DecodePod(inbox, store), 3, lambda blocks: landed.extend(blocks) or True)
    finally:
        inbox.close()
    assert result.channel == "redis" and result.num_blocks == 3
    assert landed == _blocks(3)


def test_many_pushes_at_once_each_land_whole(new_inbox):
    store, inbox = new_inbox()

    def push(k: int) -> int:
        blocks = [(block_hash(100 * k + i), genuine_value(100 * k + i)) for i in range(20)]
        return push_blocks("127.0.0.1", inbox.port, inbox.issue_ticket(f"r{k}"), blocks, timeout_s=20)

    with futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(push, range(8))) == [20] * 8
    assert store.stats.inbox_received == 160


def test_a_decode_pod_that_dies_mid_socket_push_leaves_every_block_to_the_fallback():
    """The inbox socket reads part of the first block and resets the
    connection (the pod killed): the push fails and every block, including
    those queued after the death, goes to the fallback."""
    listener = socket.create_server(("127.0.0.1", 0))

    def die_after_some_bytes():
        conn, _ = listener.accept()
        conn.recv(1000)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        conn.close()

    dying = threading.Thread(target=die_after_some_bytes, daemon=True)
    dying.start()
    servicer = _DecodePod(None, _store())
    servicer.OpenKVInbox = lambda request, context: pb.OpenKVInboxReply(port=listener.getsockname()[1],
                                                                        ticket=b"t" * 32)
    landed: list = []
    try:
        result = _push_through_sender(servicer, 4, lambda blocks: landed.extend(blocks) or True,
                                      before_the_rest=lambda: dying.join(timeout=10))
    finally:
        listener.close()
    assert result.channel == "redis" and result.num_blocks == 4 and result.error
    assert landed == _blocks(4)
    assert servicer.grpc_pushes == 0  # blocks were on the wire: never re-sent over gRPC, only to Redis
