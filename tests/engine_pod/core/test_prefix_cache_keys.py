"""The prefix cache's key log (what StreamLoad pushes to the gateways) and the
BlockPool's reports into it."""

from __future__ import annotations

import random
import threading

import pytest

from engine_pod.core.block_pool import BlockPool
from engine_pod.core.kv_cache_manager import KVCacheManager
from engine_pod.core.prefix_cache_keys import PrefixCacheKeyLog
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from kv_store.block_hash import block_key, hash_request_tokens


def hashes(n, tag="x"):
    return hash_request_tokens(list(range(n * 2)), 2, cache_salt=tag)


def keys(hs):
    return {block_key(h) for h in hs}


class Reader:
    """A StreamLoad subscriber's side: a snapshot, then net changes."""

    def __init__(self, log):
        self.log = log
        self.resyncs = 0
        self.cursor, snap = log.snapshot()
        self.keys = set(snap)

    def poll(self):
        changes = self.log.changes_since(self.cursor)
        if changes is None:
            self.resyncs += 1
            self.cursor, snap = self.log.snapshot()
            self.keys = set(snap)
            return None
        self.cursor, stored, removed = changes
        assert not set(stored) & set(removed)
        self.keys = (self.keys - set(removed)) | set(stored)
        return stored, removed


# -- the log ------------------------------------------------------------------


def test_snapshot_holds_what_is_stored_and_not_removed():
    log = PrefixCacheKeyLog()
    a, b, c = hashes(3)
    log.stored(a), log.stored(b), log.stored(c), log.removed(b)
    _, snap = log.snapshot()
    assert sorted(snap) == sorted(keys([a, c])) and len(log) == 2


def test_changes_are_net_the_last_change_of_a_key_wins():
    log = PrefixCacheKeyLog()
    a, b, c = hashes(3)
    log.stored(a)
    cursor, _ = log.snapshot()
    log.stored(b), log.removed(b)  # stored and gone within the window: only removed
    log.removed(a), log.stored(a)  # gone and back: only stored
    log.stored(c)
    new_cursor, stored, removed = log.changes_since(cursor)
    assert sorted(stored) == sorted(keys([a, c])) and removed == [block_key(b)]
    assert log.changes_since(new_cursor) == (new_cursor, [], [])


def test_a_reader_that_falls_off_the_log_must_take_a_snapshot():
    log = PrefixCacheKeyLog(max_changes=4)
    hs = hashes(6)
    cursor, _ = log.snapshot()
    for h in hs[:4]:
        log.stored(h)
    assert log.changes_since(cursor) is not None  # exactly the bound: still there
    log.stored(hs[4])
    assert log.changes_since(cursor) is None
    late_cursor, _ = log.snapshot()
    log.stored(hs[5])
    assert log.changes_since(late_cursor)[1] == [block_key(hs[5])]


def test_clear_makes_every_reader_resync():
    log = PrefixCacheKeyLog()
    a, b = hashes(2)
    log.stored(a)
    cursor, _ = log.snapshot()
    log.cleared()
    assert log.changes_since(cursor) is None
    assert log.snapshot()[1] == []
    cursor, _ = log.snapshot()
    log.stored(b)
    assert log.changes_since(cursor)[1:] == ([block_key(b)], [])


def test_two_hashes_sharing_a_key_keep_it_until_both_leave():
    log = PrefixCacheKeyLog()
    h1, h2 = b"\x01" * 8 + b"a" * 24, b"\x01" * 8 + b"b" * 24  # a 64-bit collision
    cursor, _ = log.snapshot()
    log.stored(h1), log.stored(h2), log.removed(h1)
    assert log.snapshot()[1] == [block_key(h1)]
    cursor, stored, removed = log.changes_since(cursor)
    assert stored == [block_key(h1)] and removed == []
    log.removed(h2)
    assert log.changes_since(cursor)[1:] == ([], [block_key(h1)])


def test_readers_replaying_changes_track_the_set_exactly():
    rng = random.Random(0)
    log = PrefixCacheKeyLog(max_changes=64)
    pool = hashes(200)
    cached: set[bytes] = set()
    readers = [Reader(log) for _ in range(3)]
    for _ in range(5000):
        h = rng.choice(pool)
        if h in cached:
            cached.discard(h), log.removed(h)
        else:
            cached.add(h), log.stored(h)
        if rng.random() < 0.001:
            cached.clear(), log.cleared()
        for i, reader in enumerate(readers):
            if rng.random() < 0.05 * (i + 1):  # some far behind, some close
                reader.poll()
    for reader in readers:
        reader.poll()
        assert reader.keys == keys(cached)
    assert readers[0].resyncs > 0  # the bound was exercised


def test_a_reader_on_another_thread_sees_the_writers_set():
    log = PrefixCacheKeyLog(max_changes=256)
    pool = hashes(500)
    done = threading.Event()
    cached: set[bytes] = set()

    def write():
        rng = random.Random(1)
        for _ in range(20000):
            h = rng.choice(pool)
            if h in cached:
                cached.discard(h), log.removed(h)
            else:
                cached.add(h), log.stored(h)
        done.set()

    writer = threading.Thread(target=write)
    reader = Reader(log)
    writer.start()
    while not done.is_set():
        reader.poll()
    writer.join()
    reader.poll()
    assert reader.keys == keys(cached)


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="max_changes"):
        PrefixCacheKeyLog(max_changes=0)


# -- the BlockPool's reports ----------------------------------------------------


def pool_with_log(num_blocks, caching=True):
    log = PrefixCacheKeyLog()
    return BlockPool(num_blocks, enable_caching=caching, key_log=log), log


def test_caching_full_blocks_stores_their_keys_once():
    pool, log = pool_with_log(4)
    hs = hashes(3)
    blocks = pool.get_new_blocks(3)
    cursor, _ = log.snapshot()
    pool.cache_full_blocks(blocks, hs, 0, 2)
    pool.cache_full_blocks(blocks, hs, 0, 3)  # the first two are already registered
    other = pool.get_new_blocks(1)
    pool.cache_full_blocks(other, hs, 0, 1)  # same content again: stays private
    assert sorted(log.changes_since(cursor)[1]) == sorted(keys(hs))


def test_eviction_and_uncaching_remove_keys():
    pool, log = pool_with_log(3)
    hs = hashes(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hs, 0, 3)
    cursor, _ = log.snapshot()
    pool.uncache_block(blocks[2])
    pool.free_blocks(blocks)
    pool.get_new_blocks(1)  # reuses blocks[0]: evicted
    _, stored, removed = log.changes_since(cursor)
    assert stored == [] and sorted(removed) == sorted(keys([hs[0], hs[2]]))
    assert log.snapshot()[1] == [block_key(hs[1])]


def test_reset_prefix_cache_clears_the_log_only_when_it_succeeds():
    pool, log = pool_with_log(2)
    hs = hashes(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hs, 0, 2)
    cursor, _ = log.snapshot()
    assert not pool.reset_prefix_cache()  # blocks in use: refused
    assert log.changes_since(cursor) == (cursor, [], [])
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert log.changes_since(cursor) is None and log.snapshot()[1] == []


def test_without_caching_nothing_is_reported():
    pool, log = pool_with_log(3, caching=False)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes(3), 0, 3)
    assert log.snapshot() == (0, [])


def test_the_managers_log_mirrors_its_prefix_cache():
    """Random requests through a small KVCacheManager (hits, evictions,
    preemption-like frees): the log's keys are always the cached hashes' keys."""
    rng = random.Random(2)
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    reader = Reader(kv.prefix_cache_keys)
    prefixes = [list(range(i * 100, i * 100 + 12)) for i in range(5)]
    for i in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        req = Request(f"r{i}", tokens, SamplingParams(max_tokens=1))
        req.enable_block_hashing(bs)
        hits, num_hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is not None:
            req.num_computed_tokens = req.num_tokens if rng.random() < 0.8 else num_hit  # some never computed
        kv.free(req)
        if rng.random() < 0.3:
            reader.poll()
        if rng.random() < 0.01:
            assert kv.reset_prefix_cache()
    reader.poll()
    assert reader.keys == keys(kv.block_pool.cached_block_hash_to_block) != set()
