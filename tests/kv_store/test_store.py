"""Block codec, host tier, Redis tier (a real redis-server) and the tiered store."""

from __future__ import annotations

import time

import pytest
import torch

from kv_store.block_hash import hash_request_tokens
from kv_store.codec import HEADER_SIZE, BlockCodec, BlockLayout, CorruptBlockError
from kv_store.host_tier import HostMemoryTier
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.tiered_store import TieredKVStore

LAYOUT = BlockLayout(b"f" * 16, tp_rank=0, tp_size=1, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                     dtype=torch.bfloat16)


def _block(seed: int, layout: BlockLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=g).to(layout.dtype)


def _hash(i: int) -> bytes:
    return hash_request_tokens(list(range(i, i + 4)), 4)[0]


# -- codec --------------------------------------------------------------------
def test_codec_round_trip():
    codec = BlockCodec(LAYOUT)
    block = _block(1)
    value = codec.encode(_hash(0), block)
    assert len(value) == HEADER_SIZE + LAYOUT.payload_bytes
    assert torch.equal(codec.decode(_hash(0), value), block)


@pytest.mark.parametrize("field,change", [
    ("fingerprint", dict(fingerprint=b"g" * 16)),
    ("tp_rank", dict(tp_rank=1, tp_size=2)),
    ("num_layers", dict(num_layers=3)),
    ("block_size", dict(block_size=8)),
    ("dtype", dict(dtype=torch.float16)),
])
def test_codec_rejects_a_different_layout(field, change):
    value = BlockCodec(LAYOUT).encode(_hash(0), _block(1))
    other = BlockLayout(**{**LAYOUT.__dict__, **change})
    with pytest.raises(CorruptBlockError):
        BlockCodec(other).decode(_hash(0), value)


def test_codec_detects_flipped_truncated_and_misaddressed_values():
    codec = BlockCodec(LAYOUT)
    value = codec.encode(_hash(0), _block(1))
    flipped = bytearray(value)
    flipped[HEADER_SIZE + 100] ^= 0x40
    with pytest.raises(CorruptBlockError, match="checksum"):
        codec.decode(_hash(0), bytes(flipped))
    with pytest.raises(CorruptBlockError):
        codec.decode(_hash(0), value[:-7])
    with pytest.raises(CorruptBlockError):
        codec.decode(_hash(0), value[: HEADER_SIZE - 1])
    with pytest.raises(CorruptBlockError, match="block_hash"):
        codec.decode(_hash(1), value)


# -- host tier -----------------------------------------------------------------
def test_host_tier_respects_its_byte_budget_in_lru_order():
    value_size = 100
    host = HostMemoryTier(capacity_bytes=3 * value_size)
    for i in range(3):
        assert host.put(_hash(i), bytes(value_size))
    assert host.get(_hash(0)) is not None  # touch: 0 becomes most recent
    host.put(_hash(3), bytes(value_size))  # evicts the least recent: 1
    assert _hash(1) not in host
    assert host.lru_order() == [_hash(2), _hash(0), _hash(3)]
    assert host.used_bytes == 3 * value_size and host.evictions == 1
    assert not host.put(_hash(9), bytes(4 * value_size))  # never fits
    assert host.num_leading_hits([_hash(2), _hash(0), _hash(1), _hash(3)]) == 2


# -- Redis tier ------------------------------------------------------------------
def _redis_tier(url: str, **kw) -> RedisTier:
    return RedisTier(RedisTierConfig(url=url, **kw), namespace="tessera:fp:0/1:")


def test_redis_tier_round_trip_with_namespace_and_ttl(redis_server):
    tier = _redis_tier(redis_server.url, ttl_seconds=120)
    assert tier.available
    assert tier.put_many([(_hash(0), b"a"), (_hash(1), b"b")])
    assert tier.get_many([_hash(0), _hash(2), _hash(1)]) == [b"a", None, b"b"]
    key = b"tessera:fp:0/1:" + _hash(0).hex().encode()
    assert redis_server.client.get(key) == b"a"
    assert 0 < redis_server.client.ttl(key) <= 120
    assert tier.exists_many([_hash(1), _hash(5)]) == [True, False]


def test_redis_tier_unreachable_is_a_miss_not_an_error():
    tier = _redis_tier("redis://127.0.0.1:1/0", timeout_seconds=0.1)
    assert not tier.available
    assert tier.get_many([_hash(0)]) == [None]
    assert not tier.put_many([(_hash(0), b"x")])


def test_redis_tier_authenticates_from_the_url(tmp_path):
    from kv_store.local_redis import RedisServer

    server = RedisServer(tmp_path, password="s3cret")
    try:
        tier = _redis_tier(server.url)
        assert tier.available and tier.put_many([(_hash(0), b"v")])
        assert tier.get_many([_hash(0)]) == [b"v"]
        wrong = _redis_tier(server.url.replace("s3cret", "wrong"))
        assert not wrong.available and wrong.get_many([_hash(0)]) == [None]
    finally:
        server.stop()


def test_redis_tier_spreads_blocks_over_a_redis_cluster(tmp_path):
    from kv_store.local_redis import RedisClusterServers

    cluster = RedisClusterServers(tmp_path)
    try:
        tier = _redis_tier(cluster.url, cluster=True, timeout_seconds=2.0)
        items = [(_hash(i), f"value-{i}".encode()) for i in range(40)]
        assert tier.put_many(items)
        assert tier.get_many([h for h, _ in items]) == [v for _, v in items]
        assert tier.exists_many([_hash(0), _hash(99)]) == [True, False]
        store = TieredKVStore(BlockCodec(LAYOUT), HostMemoryTier(0), tier)
        store.put(_hash(100), _block(3), sync_remote=True)
        assert torch.equal(store.get_blocks([_hash(100)])[0], _block(3))
        # The keys landed on more than one node.
        import redis as redis_py

        sizes = [redis_py.Redis(port=int(n.args[2])).dbsize() for n in cluster.nodes]
        assert sum(1 for s in sizes if s) > 1
    finally:
        cluster.stop()


def test_redis_config_rejects_bad_values():
    with pytest.raises(ValueError, match="kv_redis_url"):
        RedisTierConfig(url="http://x")
    with pytest.raises(ValueError, match="kv_redis_ttl"):
        RedisTierConfig(url="redis://x", ttl_seconds=0)


# -- tiered store ------------------------------------------------------------------
def _store(url: str | None = None, host_bytes: int = 1 << 20, **kw) -> TieredKVStore:
    remote = _redis_tier(url) if url else None
    return TieredKVStore(BlockCodec(LAYOUT), HostMemoryTier(host_bytes), remote, **kw)


def test_put_reaches_both_tiers_and_get_promotes(redis_server):
    store = _store(redis_server.url)
    blocks = [_block(i) for i in range(3)]
    for i, b in enumerate(blocks):
        store.put(_hash(i), b)
    assert store.flush()
    assert store.lookup([_hash(0), _hash(1), _hash(2), _hash(3)]) == 3
    # A second store (another pod) with an empty host tier reads from Redis.
    other = _store(redis_server.url)
    got = other.get_blocks([_hash(0), _hash(1), _hash(2), _hash(3)])
    assert len(got) == 3 and all(torch.equal(g, b) for g, b in zip(got, blocks))
    assert other.stats.redis_hits == 3 and other.stats.host_hits == 0
    assert other.get_blocks([_hash(0)]) and other.stats.host_hits == 1  # promoted
    store.close()
    other.close()


def test_corrupt_redis_value_is_a_miss_deleted_and_counted(redis_server):
    store = _store(redis_server.url)
    for i in range(3):
        store.put(_hash(i), _block(i), sync_remote=True)
    key = store.remote.key(_hash(1))
    value = bytearray(redis_server.client.get(key))
    value[-3] ^= 0xFF
    redis_server.client.set(key, bytes(value))
    reader = _store(redis_server.url)
    got = reader.get_blocks([_hash(0), _hash(1), _hash(2)])
    assert len(got) == 1  # the run stops at the corrupt block
    assert reader.stats.corrupt_values == 1
    assert redis_server.client.get(key) is None
    truncated = store.remote.key(_hash(2))
    redis_server.client.set(truncated, redis_server.client.get(truncated)[:50])
    assert reader.get_blocks([_hash(2)]) == [] and reader.stats.corrupt_values == 2


def test_write_behind_drops_when_the_queue_is_full(redis_server):
    store = _store(redis_server.url, write_queue_size=1)
    redis_server.proc.send_signal(__import__("signal").SIGSTOP)  # Redis stalls: the queue fills
    try:
        for i in range(20):
            store.put(_hash(i), _block(i))
        assert store.stats.writes_dropped > 0
        assert len(store.host) == 20  # the host tier took every block
    finally:
        redis_server.proc.send_signal(__import__("signal").SIGCONT)
    store.close()


def test_redis_killed_mid_run_degrades_to_misses(redis_server):
    store = _store(redis_server.url, host_bytes=0)
    store.put(_hash(0), _block(0), sync_remote=True)
    assert len(store.get_blocks([_hash(0)])) == 1
    redis_server.stop()
    start = time.monotonic()
    assert store.get_blocks([_hash(0)]) == []
    store.put(_hash(1), _block(1), sync_remote=True)  # no exception
    assert time.monotonic() - start < 2.0
    assert store.remote.errors >= 1


def test_salts_never_share_blocks_in_any_tier(redis_server):
    store = _store(redis_server.url)
    tokens = list(range(40))
    a = hash_request_tokens(tokens, 4, cache_salt="tenant-a")
    b = hash_request_tokens(tokens, 4, cache_salt="tenant-b")
    for i, h in enumerate(a):
        store.put(h, _block(i), sync_remote=True)
    assert store.lookup(a) == len(a)
    assert store.lookup(b) == 0
    assert _store(redis_server.url, host_bytes=0).get_blocks(b) == []
