"""The direct P/D channel's two halves in one process: the store's sender
streaming a transfer to a real gRPC server on loopback (a stand-in decode
pod that can refuse or fail mid-push), and the store's inbox taking pushed
values and serving them, verified, between the host tier and Redis."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from kv_store.direct_sender import DirectSender, DirectSenderConfig
from kv_store.host_tier import HostMemoryTier
from kv_store.tiered_store import TieredKVStore
from tessera.internal_channel import InternalClient
from tessera.internal_secret import InternalSecret
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.kv_store.blocks import (
    FORGERIES, OTHER_KEY, block_hash, genuine_value, make_codec, make_payload, make_redis_tier,
)

SECRET = InternalSecret.from_text("direct-channel-tests-0123456789abcdef")


class _DecodePod(pb_grpc.EngineServicer):
    """Takes pushes; ``fail_after``: abort after that many messages (a refusal or a death mid-push)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.messages: list[pb.PushKVBlocksRequest] = []
        self.metadata: list[tuple] = []

    def PushKVBlocks(self, request_iterator, context):
        self.metadata.append(tuple(context.invocation_metadata()))
        n = 0
        for message in request_iterator:
            self.messages.append(message)
            if self.fail_after is not None and len(self.messages) >= self.fail_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "decode pod going away")
            n += len(message.blocks)
        return pb.PushKVBlocksReply(num_blocks=n)


def _serve(servicer: _DecodePod) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def decode_pod():
    servicer = _DecodePod()
    server, address = _serve(servicer)
    yield servicer, address
    server.stop(None)


def test_channels_to_decode_pods_that_come_and_go_are_bounded():
    """Pushes to three decode pods in turn, at most two channels kept: the
    least recently used is closed, and a push to its pod dials anew."""
    servers = [_serve(_DecodePod()) for _ in range(3)]
    sender = _sender(max_channels=2)
    try:
        for i, (_, address) in enumerate([*servers, servers[0]]):
            sender.send(f"req-{i}", address, block_hash(i), _encoded(i))
            assert sender.finish(f"req-{i}").result(timeout=10).channel == "direct"
        assert list(sender._channels) == [servers[2][1], servers[0][1]]
    finally:
        sender.close()
        for server, _ in servers:
            server.stop(None)


def _sender(fallback=None, **config) -> DirectSender:
    codec = make_codec()
    return DirectSender(codec.sign, fallback, lambda: InternalClient(SECRET), DirectSenderConfig(**config))


def _encoded(i: int) -> bytes:
    return make_codec().encode(block_hash(i), make_payload(i))


def test_a_transfer_streams_its_blocks_signed_with_the_token(decode_pod):
    servicer, address = decode_pod
    sender = _sender()
    for i in range(5):
        sender.send("req-1", address, block_hash(i), _encoded(i))
    result = sender.finish("req-1").result(timeout=10)
    assert (result.channel, result.num_blocks, result.error) == ("direct", 5, None)
    pushed = [(b.block_hash, b.value) for m in servicer.messages for b in m.blocks]
    assert pushed == [(block_hash(i), genuine_value(i)) for i in range(5)]  # signed on the way
    assert result.num_bytes == sum(len(v) for _, v in pushed)
    assert set(SECRET.metadata()) <= set(servicer.metadata[0])  # a pod checks the token as the gateway's
    sender.close()


def test_blocks_queued_together_share_a_message_up_to_the_limit(decode_pod):
    servicer, address = decode_pod
    value_bytes = len(_encoded(0))
    sender = _sender(max_message_bytes=2 * value_bytes)
    gate = threading.Event()
    original = sender._sign
    sender._sign = lambda v: gate.wait(5) and original(v)  # hold the first message until all are queued
    for i in range(5):
        sender.send("req", address, block_hash(i), _encoded(i))
    gate.set()
    assert sender.finish("req").result(timeout=10).channel == "direct"
    assert [len(m.blocks) for m in servicer.messages] == [2, 2, 1]
    sender.close()


def test_a_transfer_that_queued_nothing_finishes_at_once():
    result = _sender().finish("nothing").result(timeout=1)
    assert (result.channel, result.num_blocks) == ("direct", 0)


@pytest.mark.parametrize("fallback_lands", [True, False])
def test_a_failed_push_sends_every_block_to_the_fallback(decode_pod, fallback_lands):
    """The decode pod fails after the first message; blocks queued after the
    failure still reach the fallback, all of them signed."""
    servicer, address = decode_pod
    servicer.fail_after = 1
    landed = []
    sender = _sender(fallback=lambda blocks: landed.extend(blocks) or fallback_lands)
    sender.send("req", address, block_hash(0), _encoded(0))
    while not servicer.messages:
        threading.Event().wait(0.01)
    for i in range(1, 4):
        sender.send("req", address, block_hash(i), _encoded(i))
    result = sender.finish("req").result(timeout=10)
    assert landed == [(block_hash(i), genuine_value(i)) for i in range(4)]
    assert result.channel == ("redis" if fallback_lands else "none") and result.num_blocks == 4
    assert "UNAVAILABLE" in result.error
    sender.close()


def test_a_cancelled_transfer_falls_back_to_nothing(decode_pod):
    servicer, address = decode_pod
    servicer.fail_after = 1
    landed = []
    sender = _sender(fallback=lambda blocks: landed.extend(blocks) or True)
    sender.send("req", address, block_hash(0), _encoded(0))
    sender.cancel("req")
    assert sender.finish("req").result(timeout=1).num_blocks == 0  # gone: a new, empty transfer
    threading.Event().wait(0.3)
    assert landed == []
    sender.close()


def test_a_push_nobody_answers_times_out_into_the_fallback():
    """A peer that accepts the connection and never replies: the push's deadline ends it."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    landed = []
    try:
        sender = _sender(fallback=lambda blocks: landed.extend(blocks) or True, timeout_s=0.5)
        sender.send("req", f"127.0.0.1:{listener.getsockname()[1]}", block_hash(0), _encoded(0))
        result = sender.finish("req").result(timeout=10)
        assert result.channel == "redis" and len(landed) == 1
    finally:
        listener.close()


# -- the receiving half: the store's inbox -----------------------------------
def _store(redis_url: str | None = None, inbox_bytes: int = 1 << 20) -> TieredKVStore:
    remote = make_redis_tier(redis_url) if redis_url else None
    return TieredKVStore(make_codec(), HostMemoryTier(0), remote, inbox=HostMemoryTier(inbox_bytes))


def test_pushed_values_serve_reads_after_the_host_tier_and_before_redis(redis_server):
    store = _store(redis_server.url)
    store.receive([(block_hash(i), genuine_value(i)) for i in range(2)])
    redis_only = _store(redis_server.url)
    redis_only.put(block_hash(2), make_payload(2), sync_remote=True)
    assert store.get_blocks([block_hash(i) for i in range(3)]) == [make_payload(i) for i in range(3)]
    assert (store.stats.inbox_hits, store.stats.redis_hits) == (2, 1)
    assert store.stats.inbox_received == 2


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_push_is_refused_when_read_and_deleted(forgery):
    store = _store()
    forge, reason = FORGERIES[forgery]
    value = forge(genuine_value(0))
    if len(value) != store.value_bytes:  # refused at once, unread
        with pytest.raises(ValueError, match="bytes"):
            store.receive([(block_hash(0), value)])
        assert len(store.inbox) == 0
        return
    store.receive([(block_hash(0), value)])
    assert store.get_blocks([block_hash(0)]) == []
    assert store.stats.rejected[("inbox", reason)] == 1 and block_hash(0) not in store.inbox


def test_a_value_signed_under_another_deployments_key_is_refused():
    store = _store()
    other = make_codec(OTHER_KEY)
    store.receive([(block_hash(0), other.sign(other.encode(block_hash(0), make_payload(0))))])
    assert store.get_blocks([block_hash(0)]) == []
    assert store.stats.rejected[("inbox", "mac")] == 1


def test_a_store_without_an_inbox_takes_no_push():
    store = TieredKVStore(make_codec(), HostMemoryTier(0))
    with pytest.raises(ValueError, match="kv-inbox-bytes"):
        store.receive([(block_hash(0), genuine_value(0))])


def test_the_inbox_is_bounded():
    value_bytes = len(genuine_value(0))
    store = _store(inbox_bytes=3 * value_bytes)
    store.receive([(block_hash(i), genuine_value(i)) for i in range(5)])
    assert len(store.inbox) == 3 and store.inbox.used_bytes == 3 * value_bytes
    assert store.get_blocks([block_hash(4)]) == [make_payload(4)]
