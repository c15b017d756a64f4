"""The scheduler side of the KV connector with a real store (host tier only)."""

from __future__ import annotations

from engine_pod.core.kv_cache_block import KVCacheBlock
from engine_pod.core.kv_connector import KVConnectorScheduler
from kv_store.block_hash import hash_request_tokens
from kv_store.codec import BlockCodec, BlockLayout
from kv_store.host_tier import HostMemoryTier
from kv_store.tiered_store import TieredKVStore

LAYOUT = BlockLayout(b"f" * 16, tp_rank=0, tp_size=1, num_layers=1, block_size=4, num_kv_heads=1, head_dim=2,
                     dtype="float32")


def _connector(host_bytes: int) -> KVConnectorScheduler:
    return KVConnectorScheduler(TieredKVStore(BlockCodec(LAYOUT), HostMemoryTier(host_bytes)), block_size=4)


def _cached_block(block_id: int) -> KVCacheBlock:
    return KVCacheBlock(block_id, block_hash=hash_request_tokens([block_id] * 4, 4)[0])


def test_an_evicted_block_is_offloaded_to_the_host_tier():
    connector = _connector(host_bytes=1 << 20)
    connector.on_evict(_cached_block(1))
    connector.on_evict(KVCacheBlock(2))  # never cached: nothing to keep
    assert [block_id for block_id, _ in connector.take_metadata().offloads] == [1]


def test_without_a_host_tier_nothing_is_offloaded():
    """A store of Redis alone: the copy of an evicted block would be encoded and dropped."""
    connector = _connector(host_bytes=0)
    connector.on_evict(_cached_block(1))
    assert connector.take_metadata() is None
