"""KVCacheManager: block tables, prefix caching, and leak freedom."""

from __future__ import annotations

import random

from engine_pod.core.kv_cache_manager import KVCacheManager
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams

BS = 4


def make_req(rid, tokens, salt=None, bs=BS):
    req = Request(rid, list(tokens), SamplingParams(max_tokens=16), cache_salt=salt)
    req.enable_block_hashing(bs)  # as Scheduler.add_request does
    return req


def admit(kv, req, num_new=None):
    """Schedule a waiting request like the scheduler: prefix lookup, allocation,
    then advance num_computed_tokens. ``num_new`` caps the chunk (default: the
    rest of the prompt). Returns (hits, new_blocks)."""
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = min(num_new or req.num_tokens, req.num_tokens - num_hit)
    new = kv.allocate_slots(req, num_new, hits, num_hit)
    if new is not None:
        kv.record_prefix_lookup(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit + num_new
    return hits, new


def assert_all_free(kv):
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert len(pool.free_block_queue.get_all_free_blocks()) == kv.num_blocks
    assert kv.req_to_blocks == {}
    assert kv.num_cached_blocks == {}
    # The hash map is consistent with the blocks' own hashes.
    for h, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == h


PROMPT = list(range(100, 110))  # 2.5 blocks


def test_only_full_blocks_are_cached():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_req("a", PROMPT)
    hits, blocks = admit(kv, req)
    assert hits == []
    assert len(blocks) == 3
    cache = kv.block_pool.cached_block_hash_to_block
    assert len(cache) == 2
    assert blocks[0].block_hash == req.block_hashes[0]
    assert blocks[1].block_hash == req.block_hashes[1]
    assert blocks[2].block_hash is None
    assert cache[req.block_hashes[0]] is blocks[0]
    assert kv.get_block_ids("a") == [b.block_id for b in blocks]
    assert kv.num_allocated_slots("a") == 3 * BS


def test_second_request_hits_cached_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", PROMPT)
    _, a_blocks = admit(kv, a)
    b = make_req("b", PROMPT)
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == a_blocks[:2]
    assert num_hit == 2 * BS
    new = kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    assert len(new) == 1
    assert kv.req_to_blocks["b"][:2] == a_blocks[:2]
    assert [blk.ref_cnt for blk in a_blocks] == [2, 2, 1]
    assert kv.block_pool.get_num_free_blocks() == 10 - 4


def test_hit_stops_at_first_differing_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_req("a", list(range(100, 116))))
    other = list(range(100, 116))
    other[5] = 1  # block 1 differs
    hits, num_hit = kv.get_computed_blocks(make_req("b", other))
    assert len(hits) == 1 and num_hit == BS


def test_exact_full_blocks_prompt_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    three_blocks = list(range(100, 112))
    a = make_req("a", three_blocks)
    admit(kv, a)
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    hits, num_hit = kv.get_computed_blocks(make_req("b", three_blocks))
    assert len(hits) == 2 and num_hit == 2 * BS  # not 3: the last token must be computed
    # With one more token, all three blocks are hits.
    hits, num_hit = kv.get_computed_blocks(make_req("c", three_blocks + [5]))
    assert len(hits) == 3 and num_hit == 3 * BS


def test_prefix_cache_stats_count_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_req("a", PROMPT))
    admit(kv, make_req("b", PROMPT))
    admit(kv, make_req("c", [1, 2, 3]))
    stats = kv.prefix_cache_stats.reset()
    assert stats.queries == 10 + 10 + 3
    assert stats.hits == 0 + 8 + 0
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (0, 0)


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    admit(kv, make_req("a", PROMPT, salt="tenant-1"))
    assert kv.get_computed_blocks(make_req("b", PROMPT, salt="tenant-2")) == ([], 0)
    assert kv.get_computed_blocks(make_req("c", PROMPT)) == ([], 0)
    hits, num_hit = kv.get_computed_blocks(make_req("d", PROMPT, salt="tenant-1"))
    assert num_hit == 2 * BS and len(hits) == 2


def test_allocate_slots_too_big_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    req = make_req("big", list(range(100, 113)))  # needs 4 blocks
    free_before = kv.block_pool.get_num_free_blocks()
    assert kv.allocate_slots(req, req.num_tokens) is None
    assert kv.block_pool.get_num_free_blocks() == free_before == 3
    assert "big" not in kv.req_to_blocks
    assert "big" not in kv.num_cached_blocks
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_failed_growth_keeps_existing_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    req = make_req("r", list(range(100, 120)))  # 5 blocks in all
    _, first = admit(kv, req, num_new=8)
    assert len(first) == 2
    assert kv.allocate_slots(req, 12) is None  # would need 3 more, 1 free
    assert kv.req_to_blocks["r"] == first
    assert kv.block_pool.get_num_free_blocks() == 1
    assert [b.ref_cnt for b in first] == [1, 1]


def test_revived_hits_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    pool = kv.block_pool
    a = make_req("a", PROMPT)
    admit(kv, a)
    kv.free(a)
    assert pool.get_num_free_blocks() == 4  # 2 of them still cached

    # 2 hits (free, ref 0) + 3 new blocks: the hits leave only 2 to allocate.
    too_big = make_req("b", PROMPT[:8] + list(range(200, 209)))  # 17 tokens: 5 blocks
    hits, num_hit = kv.get_computed_blocks(too_big)
    assert len(hits) == 2 and all(h.ref_cnt == 0 for h in hits)
    assert kv.allocate_slots(too_big, too_big.num_tokens - num_hit, hits, num_hit) is None
    assert pool.get_num_free_blocks() == 4
    assert all(h.ref_cnt == 0 for h in hits)
    assert "b" not in kv.req_to_blocks

    # 2 hits + 2 new blocks: exactly fits.
    fits = make_req("c", PROMPT[:8] + list(range(200, 208)))  # 16 tokens: 4 blocks
    hits, new = admit(kv, fits)
    assert len(hits) == 2 and new is not None and len(new) == 2
    assert pool.get_num_free_blocks() == 0
    assert all(b.ref_cnt == 1 for b in pool.blocks)
    assert not set(hits) & set(new)


def test_hits_in_use_are_not_counted_as_revived():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_req("a", PROMPT)
    admit(kv, a)  # holds 3 blocks, 2 cached; 2 free left
    b = make_req("b", PROMPT[:8] + list(range(200, 208)))  # 2 hits (in use) + 2 new
    hits, new = admit(kv, b)
    assert new is not None and len(new) == 2
    assert [h.ref_cnt for h in hits] == [2, 2]
    assert kv.block_pool.get_num_free_blocks() == 0


def test_no_hits_without_caching():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = make_req("a", PROMPT)
    admit(kv, a)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_req("b", PROMPT)) == ([], 0)
    kv.free(a)
    assert kv.get_computed_blocks(make_req("c", PROMPT)) == ([], 0)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


def test_no_leak_after_mixed_workload():
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=400, block_size=BS)
    prefixes = [list(range(1000 * p, 1000 * p + 12)) for p in range(3)]
    live: list[Request] = []
    for i in range(40):
        prompt = list(rng.choice(prefixes)) + [rng.randrange(50, 900) for _ in range(rng.randrange(0, 15))]
        req = make_req(f"r{i}", prompt)
        # Prefill in chunks of up to 5 tokens.
        hits, new = admit(kv, req, num_new=5)
        assert new is not None
        while req.num_computed_tokens < req.num_tokens and rng.random() < 0.8:
            n = min(5, req.num_tokens - req.num_computed_tokens)
            assert kv.allocate_slots(req, n) is not None
            req.num_computed_tokens += n
        # Some requests decode a few tokens.
        if req.num_computed_tokens == req.num_tokens:
            for _ in range(rng.randrange(0, 6)):
                req.append_output_token_ids([rng.randrange(50, 900)])
                assert kv.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
        live.append(req)
        # Free (finish or abort) a random earlier request now and then.
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.randrange(len(live))))
    assert kv.block_pool.get_num_free_blocks() < kv.num_blocks
    assert kv.prefix_cache_stats.hits > 0  # the prefixes were shared
    rng.shuffle(live)
    for req in live:
        kv.free(req)
    assert_all_free(kv)
    assert len(kv.block_pool.cached_block_hash_to_block) > 0  # cached content survives freeing


def test_preempted_in_same_step_uncaches_uncomputed_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(100, 113))  # 3 full blocks + 1 token
    req = make_req("a", tokens)
    _, first = admit(kv, req, num_new=8)  # blocks 0, 1 computed in an earlier step
    assert req.num_computed_tokens == 8
    new = kv.allocate_slots(req, 5)  # this step: blocks 2 (full) and 3 (partial)
    assert new is not None and len(new) == 2
    blocks = kv.req_to_blocks["a"]
    assert blocks[2].block_hash == req.block_hashes[2]  # registered at scheduling time
    # Preempted in the same step: num_computed_tokens never advanced.
    kv.free(req)
    pool = kv.block_pool
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert pool.get_cached_block(req.block_hashes[2]) is None
    assert blocks[2].block_hash is None
    assert_all_free(kv)
    # A later request with the same prompt only hits what was really computed.
    hits, num_hit = kv.get_computed_blocks(make_req("b", tokens))
    assert hits == blocks[:2] and num_hit == 8


def test_finished_request_keeps_computed_blocks_cached():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(100, 112))
    req = make_req("a", tokens + [1])
    admit(kv, req)
    kv.free(req)
    hits, num_hit = kv.get_computed_blocks(make_req("b", tokens + [2]))
    assert num_hit == 12 and len(hits) == 3


def test_num_cached_prefix_blocks_counts_the_leading_run_only():
    """The load report's prefix match: leading cached blocks, stopping at the first miss."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_req("a", PROMPT)  # two full blocks cached after admission
    admit(kv, req)
    other = make_req("b", list(range(500, 512))).block_hashes
    assert kv.num_cached_prefix_blocks(req.block_hashes) == 2
    assert kv.num_cached_prefix_blocks(req.block_hashes[:1]) == 1
    assert kv.num_cached_prefix_blocks([req.block_hashes[0], other[1], req.block_hashes[1]]) == 1
    assert kv.num_cached_prefix_blocks(other) == 0
    assert kv.num_cached_prefix_blocks([]) == 0
    # The same lookup as admission's: what it counts is what a new request would hit.
    twin = make_req("c", PROMPT + [7, 7])
    assert kv.get_computed_blocks(twin)[1] == kv.num_cached_prefix_blocks(twin.block_hashes) * BS
