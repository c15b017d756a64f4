"""The gateway's index of the pods' pushed prefix caches
(gateway/pods/prefix_index.py): what a pod pushes is what the router reads,
a reset replaces it, a pod that leaves takes its keys along, and a pod
cannot push more keys than its KV pool holds."""

from __future__ import annotations

import logging

from gateway.config import gateway_config_from_dict
from gateway.pods import PodPool
from gateway.pods.prefix_index import MAX_HOLDERS_SCANNED, PENDING_TTL_S, PrefixIndex
from kv_store.block_hash import block_key, hash_request_tokens
from tessera.v1 import engine_pb2 as epb
from tests.fake_clock import FakeClock

BLOCK = 16


def keys_of(conversation: int, blocks: int) -> list[int]:
    tokens = [conversation * 100_003 + i for i in range(blocks * BLOCK)]
    return [block_key(h) for h in hash_request_tokens(tokens, BLOCK)]


def push(index: PrefixIndex, address: str, stored=(), removed=(), reset=False, num_kv_blocks=512) -> None:
    index.apply(address, epb.PrefixCacheKeys(reset=reset, stored=list(stored), removed=list(removed)), num_kv_blocks)


def test_matched_blocks_are_the_leading_keys_the_pod_pushed():
    index = PrefixIndex()
    index.add("a:1")
    prompt = keys_of(1, 6)
    push(index, "a:1", stored=prompt[:4], reset=True)
    assert index.matched_blocks("a:1", prompt) == 4
    push(index, "a:1", removed=[prompt[1]])
    assert index.matched_blocks("a:1", prompt) == 1  # a hole ends the match, as in the pod's own lookup
    assert index.matched_blocks("b:1", prompt) == 0  # an unknown pod holds nothing


def test_a_reset_replaces_the_set_and_clear_forgets_it():
    index = PrefixIndex()
    index.add("a:1")
    old, new = keys_of(1, 3), keys_of(2, 3)
    push(index, "a:1", stored=old, reset=True)
    push(index, "a:1", stored=new, reset=True)
    assert index.matched_blocks("a:1", old) == 0
    assert index.matched_blocks("a:1", new) == 3
    assert index.deepest_holders(old) == (0, [])
    index.clear("a:1")
    assert index.matched_blocks("a:1", new) == 0
    assert index.num_keys() == 0


def test_deepest_holders_narrow_to_the_pods_holding_the_whole_run():
    index = PrefixIndex()
    for address in ("a:1", "b:1", "c:1"):
        index.add(address)
    prompt = keys_of(7, 8)
    push(index, "a:1", stored=prompt[:2])   # the shared head only
    push(index, "b:1", stored=prompt[:6])   # the deepest whole run
    push(index, "c:1", stored=prompt[3:8])  # deeper blocks without the head: no match
    assert index.deepest_holders(prompt) == (6, ["b:1"])
    assert sorted(index.deepest_holders(prompt[:2])[1]) == ["a:1", "b:1"]
    assert index.deepest_holders(keys_of(8, 3)) == (0, [])


def test_a_removed_pod_takes_its_keys_and_its_slot_is_reused_clean():
    index = PrefixIndex()
    index.add("a:1")
    index.add("b:1")
    prompt = keys_of(3, 4)
    push(index, "a:1", stored=prompt)
    push(index, "b:1", stored=prompt)
    index.remove("a:1")
    assert index.deepest_holders(prompt) == (4, ["b:1"])
    index.add("d:1")  # takes a:1's slot: none of a:1's keys may show up as d:1's
    assert index.matched_blocks("d:1", prompt) == 0
    assert index.deepest_holders(prompt) == (4, ["b:1"])
    index.remove("b:1")
    assert index.num_keys() == 0


def test_a_pod_cannot_push_more_keys_than_its_kv_pool(caplog):
    index = PrefixIndex()
    index.add("a:1")
    with caplog.at_level(logging.WARNING):
        push(index, "a:1", stored=keys_of(4, 100), num_kv_blocks=10)
        push(index, "a:1", stored=keys_of(5, 100), num_kv_blocks=10)
    assert index.num_keys() == 10
    assert sum("more prefix-cache keys than its 10 KV blocks" in r.message for r in caplog.records) == 1


def test_a_pod_claiming_a_huge_kv_pool_is_believed_up_to_the_configured_cap():
    index = PrefixIndex(max_keys_per_pod=8)
    index.add("a:1")
    push(index, "a:1", stored=keys_of(4, 100), num_kv_blocks=2**31 - 1)
    index.note_routed("a:1", keys_of(5, 100))
    assert index.num_keys() == 8
    config = gateway_config_from_dict({"model": {"name": "m", "path": "/m"}, "pods": {"static": [{"address": "a:1"}]},
                                       "router": {"max_pushed_blocks_per_pod": 8}})
    assert PodPool(config.router, config.admission).prefix_index.max_keys_per_pod == 8


def test_holders_of_a_key_every_pod_holds_are_capped():
    index = PrefixIndex()
    system_prompt = keys_of(9, 2)
    for i in range(MAX_HOLDERS_SCANNED + 20):
        index.add(f"p{i}:1")
        push(index, f"p{i}:1", stored=system_prompt)
    depth, holders = index.deepest_holders(system_prompt)
    assert depth == 2 and len(holders) == MAX_HOLDERS_SCANNED == len(set(holders))


def test_a_routed_prompt_counts_as_held_until_pushed_or_expired():
    clock = FakeClock(100.0)
    index = PrefixIndex(clock)
    index.add("a:1")
    confirmed, lost = keys_of(11, 4), keys_of(12, 4)
    index.note_routed("a:1", confirmed)
    index.note_routed("a:1", lost)
    # Before any push: a burst sharing the prefix finds it on the pod it was sent to.
    assert index.matched_blocks("a:1", confirmed) == 4
    assert index.deepest_holders(lost) == (4, ["a:1"])
    push(index, "a:1", stored=confirmed)  # the pod's push confirms one prompt; the other never shows up
    clock.now += PENDING_TTL_S - 1
    push(index, "a:1")
    assert index.matched_blocks("a:1", lost) == 4  # not yet expired
    clock.now += 1
    push(index, "a:1")
    assert index.matched_blocks("a:1", confirmed) == 4
    assert index.matched_blocks("a:1", lost) == 0
    assert index.num_keys() == 4


def test_a_pending_key_the_pod_evicts_is_gone_and_a_reset_drops_pending_keys():
    clock = FakeClock(100.0)
    index = PrefixIndex(clock)
    index.add("a:1")
    prompt = keys_of(13, 3)
    index.note_routed("a:1", prompt)
    push(index, "a:1", removed=[prompt[2]])
    assert index.matched_blocks("a:1", prompt) == 2
    push(index, "a:1", reset=True)
    assert index.matched_blocks("a:1", prompt) == 0
    clock.now += PENDING_TTL_S
    push(index, "a:1", stored=prompt[:1])  # stale entries of the expiry queue are skipped
    assert index.matched_blocks("a:1", prompt) == 1
    assert index.num_keys() == 1
