"""Rules of the free-block queue and the block pool (one test per rule)."""

from __future__ import annotations

import pytest

from engine_pod.core.block_pool import BlockPool
from engine_pod.core.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock
from engine_pod.core.kv_cache_manager import KVCacheManager
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from kv_store.block_hash import hash_request_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def make_queue(n):
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def fake_hashes(n, tag="x"):
    return hash_request_tokens(list(range(n * 2)), 2, cache_salt=tag)


# -- FreeKVCacheBlockQueue ------------------------------------------------------


def test_queue_popleft_returns_head_in_order_and_counts():
    blocks, q = make_queue(5)
    assert q.num_free_blocks == 5
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.num_free_blocks == 3
    assert ids(q.get_all_free_blocks()) == [2, 3, 4]
    # A popped block is unlinked.
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None


def test_queue_remove_from_middle_relinks_neighbours():
    blocks, q = make_queue(5)
    q.remove(blocks[2])
    assert q.num_free_blocks == 4
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    # O(1): the neighbours are linked directly to each other.
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    # Removing the head and the tail works the same way.
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 3]
    assert q.popleft() is blocks[1]


def test_queue_remove_does_not_walk_the_list():
    blocks, q = make_queue(1000)
    # O(1) removal touches only the block and its two neighbours. Cut the list
    # near both ends: a removal that walked from the head or the tail to find
    # the block would hit the cut, an O(1) one never sees it.
    blocks[10].next_free_block = None
    blocks[990].prev_free_block = None
    q.remove(blocks[500])
    assert blocks[499].next_free_block is blocks[501]
    assert blocks[501].prev_free_block is blocks[499]
    assert q.num_free_blocks == 999


def test_queue_append_goes_to_tail_in_order():
    blocks, q = make_queue(5)
    a, b = q.popleft(), q.popleft()
    q.append(b)
    q.append(a)
    assert ids(q.get_all_free_blocks()) == [2, 3, 4, 1, 0]
    assert q.num_free_blocks == 5
    q.append_n([q.popleft(), q.popleft()])
    assert ids(q.get_all_free_blocks()) == [4, 1, 0, 2, 3]


def test_queue_popleft_when_empty_raises():
    blocks, q = make_queue(1)
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    assert q.num_free_blocks == 0


def test_queue_popleft_n_too_many_raises_and_pops_nothing():
    blocks, q = make_queue(3)
    with pytest.raises(ValueError):
        q.popleft_n(4)
    assert q.num_free_blocks == 3
    assert ids(q.get_all_free_blocks()) == [0, 1, 2]
    assert ids(q.popleft_n(3)) == [0, 1, 2]


def test_queue_double_append_raises():
    blocks, q = make_queue(3)
    with pytest.raises(RuntimeError):
        q.append(blocks[1])  # still in the queue
    assert q.num_free_blocks == 3
    assert ids(q.get_all_free_blocks()) == [0, 1, 2]


def test_queue_remove_of_absent_block_raises():
    blocks, q = make_queue(3)
    q.remove(blocks[1])
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])
    assert q.num_free_blocks == 2


# -- BlockPool -------------------------------------------------------------------


def test_pool_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


def test_allocation_pops_from_the_head():
    pool = BlockPool(6, enable_caching=True)
    first = pool.get_new_blocks(2)
    assert ids(first) == [0, 1]
    assert all(b.ref_cnt == 1 for b in first)
    assert pool.get_num_free_blocks() == 4
    pool.free_blocks([first[1]])  # block 1 goes to the tail
    assert ids(pool.get_new_blocks(4)) == [2, 3, 4, 5]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0


def test_allocation_beyond_free_blocks_raises_and_changes_nothing():
    pool = BlockPool(3, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_ref_counts_block_is_free_only_at_zero():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 3
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert block not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.free_block_queue.get_all_free_blocks()[-1] is block
    assert pool.get_num_free_blocks() == 4


def test_free_goes_to_tail_in_the_given_order():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 2, 0, 1]


def test_manager_free_evicts_the_requests_last_block_first():
    bs = 2
    kv = KVCacheManager(num_blocks=3, block_size=bs)
    pool = kv.block_pool
    req = Request("r", list(range(10, 16)), SamplingParams(max_tokens=1))  # 3 full blocks
    req.enable_block_hashing(bs)
    blocks = kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    assert ids(blocks) == [0, 1, 2]
    assert all(b.block_hash is not None for b in blocks)
    kv.free(req)
    # Reversed: the last block joins the queue first, so it is evicted first.
    assert pool.free_block_queue.get_all_free_blocks() == [blocks[2], blocks[1], blocks[0]]
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[2]
    assert pool.get_cached_block(req.block_hashes[2]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]


def test_revival_of_a_freed_cached_block():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = fake_hashes(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4
    hit = pool.get_cached_block(hashes[1])
    assert hit is blocks[1]
    assert hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 3
    assert hit.block_hash == hashes[1]
    assert pool.get_cached_block(hashes[1]) is hit
    # The revived block is never handed out by allocation.
    assert hit not in pool.get_new_blocks(3)


def test_eviction_on_reuse_drops_hash_and_calls_hook():
    pool = BlockPool(2, enable_caching=True)
    evicted = []
    pool.on_evict = lambda b: evicted.append((b, b.block_hash))
    blocks = pool.get_new_blocks(2)
    assert evicted == []  # nothing cached yet: no hook call
    hashes = fake_hashes(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(reversed(blocks))  # queue: 1, 0
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[1]
    assert reused.block_hash is None
    assert hashes[1] not in pool.cached_block_hash_to_block
    assert pool.get_cached_block(hashes[1]) is None
    # The hook saw the block while it still carried its hash.
    assert evicted == [(blocks[1], hashes[1])]
    # The other cached block is untouched.
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_cache_full_blocks_registers_range_and_keeps_first_duplicate():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    hashes = fake_hashes(3)
    pool.cache_full_blocks(a, hashes, 0, 2)
    assert [b.block_hash for b in a] == [hashes[0], hashes[1], None]
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, hashes, 0, 2)  # same content computed twice
    assert b[0].block_hash is None and b[1].block_hash is None
    assert pool.get_cached_block(hashes[0]) is a[0]
    assert len(pool.cached_block_hash_to_block) == 2


def test_cache_full_blocks_is_a_no_op_without_caching():
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, fake_hashes(2), 0, 2)
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in blocks)


def test_uncache_block_withdraws_without_hook():
    pool = BlockPool(2, enable_caching=True)
    calls = []
    pool.on_evict = calls.append
    blocks = pool.get_new_blocks(1)
    hashes = fake_hashes(1)
    pool.cache_full_blocks(blocks, hashes, 0, 1)
    pool.uncache_block(blocks[0])
    assert blocks[0].block_hash is None
    assert pool.get_cached_block(hashes[0]) is None
    assert calls == []


def test_reset_prefix_cache_refuses_while_blocks_in_use():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = fake_hashes(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert blocks[1].block_hash == hashes[1]
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 3
