"""The host-memory tier: a byte budget, kept in LRU order."""

from __future__ import annotations

from kv_store.host_tier import HostMemoryTier
from tests.kv_store.blocks import block_hash


def test_host_tier_respects_its_byte_budget_in_lru_order():
    value_size = 100
    host = HostMemoryTier(capacity_bytes=3 * value_size)
    for i in range(3):
        assert host.put(block_hash(i), bytes(value_size))
    assert host.get(block_hash(0)) is not None  # touch: 0 becomes most recent
    host.put(block_hash(3), bytes(value_size))  # evicts the least recent: 1
    assert block_hash(1) not in host
    assert host.lru_order() == [block_hash(2), block_hash(0), block_hash(3)]
    assert host.used_bytes == 3 * value_size and host.evictions == 1
    assert not host.put(block_hash(9), bytes(4 * value_size))  # never fits
    assert host.num_leading_hits([block_hash(2), block_hash(0), block_hash(1), block_hash(3)]) == 2
