"""The tiered store: the host tier in front of Redis, write-behind, promotion, and refused
values deleted and counted."""

from __future__ import annotations

import time

import pytest

from kv_store.block_hash import hash_request_tokens
from kv_store.codec import HEADER_SIZE, MAC_BYTES
from kv_store.host_tier import HostMemoryTier
from kv_store.tiered_store import TieredKVStore
from tests.kv_store.blocks import (
    FORGERIES, KEY, block_hash, make_codec, make_payload, make_redis_tier, tampered_payload,
)


def _store(url: str | None = None, host_bytes: int = 1 << 20, key: bytes | None = KEY, **kw) -> TieredKVStore:
    remote = make_redis_tier(url) if url else None
    return TieredKVStore(make_codec(key), HostMemoryTier(host_bytes), remote, **kw)


def test_the_redis_tier_needs_a_mac_key(redis_server):
    with pytest.raises(ValueError, match="kv_mac_key"):
        _store(redis_server.url, key=None)
    _store(key=None)  # the host tier alone needs none


def test_only_values_bound_for_redis_are_signed(redis_server):
    store = _store(redis_server.url)
    store.put(block_hash(0), make_payload(0), sync_remote=True)
    store.put(block_hash(1), make_payload(1))
    assert store.flush()
    for h in (block_hash(0), block_hash(1)):
        in_redis = redis_server.client.get(store.remote.key(h))
        assert store.codec.decode(h, in_redis) == store.codec.decode(h, store.host.get(h), verify_mac=False)
        assert store.host.get(h)[HEADER_SIZE - MAC_BYTES: HEADER_SIZE] == bytes(MAC_BYTES)
    store.close()


def test_a_steps_sync_saves_reach_redis_in_one_round_trip(redis_server):
    """A prefill pod's saves of one step: the sync ones in one pipeline (not one per block), readable
    by another pod as soon as put_many returns; the others behind, as put does."""
    store = _store(redis_server.url)
    trips = []
    put_many = store.remote.put_many
    store.remote.put_many = lambda items: trips.append(len(items)) or put_many(items)
    store.put_many([(block_hash(i), make_payload(i), i < 4) for i in range(6)])
    assert 4 in trips  # done before put_many returned
    other = _store(redis_server.url)
    assert other.get_blocks([block_hash(i) for i in range(4)]) == [make_payload(i) for i in range(4)]
    assert store.flush() and trips.count(4) == 1 and sum(trips) == 6 and store.stats.bytes_written_redis > 0
    assert all(store.host.get(block_hash(i)) for i in range(6))
    store.close()
    other.close()


def test_put_reaches_both_tiers_and_get_promotes(redis_server):
    store = _store(redis_server.url)
    blocks = [make_payload(i) for i in range(3)]
    for i, b in enumerate(blocks):
        store.put(block_hash(i), b)
    assert store.flush()
    assert store.lookup([block_hash(0), block_hash(1), block_hash(2), block_hash(3)]) == 3
    # A second store (another pod) with an empty host tier reads from Redis.
    other = _store(redis_server.url)
    got = other.get_blocks([block_hash(0), block_hash(1), block_hash(2), block_hash(3)])
    assert got == blocks
    assert other.stats.redis_hits == 3 and other.stats.host_hits == 0
    assert other.get_blocks([block_hash(0)]) and other.stats.host_hits == 1  # promoted
    store.close()
    other.close()


def test_refused_redis_values_are_misses_deleted_and_counted_by_reason(redis_server):
    """Every forgery of the codec test, planted in Redis: refused, deleted,
    counted, never promoted to the host tier."""
    writer = _store(redis_server.url)
    writer.put(block_hash(0), make_payload(0), sync_remote=True)
    genuine = redis_server.client.get(writer.remote.key(block_hash(0)))
    reader = _store(redis_server.url)
    expected: dict = {}
    for name, (make, reason) in FORGERIES.items():
        key = writer.remote.key(block_hash(0))
        redis_server.client.set(key, make(genuine))
        assert reader.get_blocks([block_hash(0), block_hash(1)]) == [], name
        assert redis_server.client.get(key) is None, name
        expected[("redis", reason)] = expected.get(("redis", reason), 0) + 1
        assert reader.stats.rejected == expected, name
    assert reader.stats.redis_hits == 0 and len(reader.host) == 0
    # The genuine value is still accepted, and the run stops at a refused one.
    for i in range(3):
        writer.put(block_hash(i), make_payload(i), sync_remote=True)
    redis_server.client.set(writer.remote.key(block_hash(1)), tampered_payload(genuine))
    got = reader.get_blocks([block_hash(0), block_hash(1), block_hash(2)])
    assert got == [make_payload(0)]
    assert reader.stats.rejected[("redis", "mac")] == expected[("redis", "mac")] + 1
    assert reader.stats.rejected_values == sum(expected.values()) + 1


def test_refused_values_are_exposed_as_a_metric_by_tier_and_reason(redis_server):
    from engine_pod.server.metrics import KVStoreCollector

    store = _store(redis_server.url)
    store.put(block_hash(0), make_payload(0), sync_remote=True)
    redis_server.client.set(store.remote.key(block_hash(0)), b"garbage")
    store.host.delete(block_hash(0))
    assert store.get_blocks([block_hash(0)]) == []
    samples = {(s.name, s.labels.get("tier"), s.labels.get("reason")): s.value
               for fam in KVStoreCollector(store, "m").collect() for s in fam.samples}
    assert samples[("tessera_kv_store_rejected_values_total", "redis", "truncated")] == 1
    assert samples[("tessera_kv_store_rejected_values_total", "redis", "mac")] == 0
    assert samples[("tessera_kv_store_rejected_values_total", "host", "mac")] == 0


def test_write_behind_drops_when_the_queue_is_full(redis_server):
    store = _store(redis_server.url, write_queue_size=1)
    redis_server.proc.send_signal(__import__("signal").SIGSTOP)  # Redis stalls: the queue fills
    try:
        for i in range(20):
            store.put(block_hash(i), make_payload(i))
        assert store.stats.writes_dropped > 0
        assert len(store.host) == 20  # the host tier took every block
    finally:
        redis_server.proc.send_signal(__import__("signal").SIGCONT)
    store.close()


def test_redis_killed_mid_run_degrades_to_misses(redis_server):
    store = _store(redis_server.url, host_bytes=0)
    store.put(block_hash(0), make_payload(0), sync_remote=True)
    assert len(store.get_blocks([block_hash(0)])) == 1
    redis_server.stop()
    start = time.monotonic()
    assert store.get_blocks([block_hash(0)]) == []
    store.put(block_hash(1), make_payload(1), sync_remote=True)  # no exception
    assert time.monotonic() - start < 2.0
    assert store.remote.errors >= 1


def test_salts_never_share_blocks_in_any_tier(redis_server):
    store = _store(redis_server.url)
    tokens = list(range(40))
    a = hash_request_tokens(tokens, 4, cache_salt="tenant-a")
    b = hash_request_tokens(tokens, 4, cache_salt="tenant-b")
    for i, h in enumerate(a):
        store.put(h, make_payload(i), sync_remote=True)
    assert store.lookup(a) == len(a)
    assert store.lookup(b) == 0
    assert _store(redis_server.url, host_bytes=0).get_blocks(b) == []
