"""Routing on the pods' pushed prefix caches (`router.prefix_match: pushed`,
gateway/router.py and gateway/pods/prefix_index.py): no prefix query on the
request path whatever the fleet size, the same choice the per-request
queries make, and a conversation found on a pod the hash ring does not name.

Pods are routable Pod objects without engines (tests/gateway/test_router.py's
pool) whose Engine stub logs any GetLoad; what a pod "pushed" is applied to
the pool's index as its load stream would. tests/gateway/test_simulated_fleet.py
runs the same policy over real simulated pods and their real load streams.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import GatewayConfigError, RouterConfig, gateway_config_from_dict
from gateway.router import Router
from kv_store.block_hash import block_key
from tessera.v1 import engine_pb2 as epb
from tests.gateway.test_router_bounded import BASE, BLOCK, addresses, deepest_ladder_owner, fleet, prompt, route

PUSHED = RouterConfig(policy="bounded", prefix_match="pushed")


def pushed_fleet(config: RouterConfig, size: int):
    pool, log = fleet(config, addresses(size))
    for address in pool.pods:
        pool.prefix_index.add(address)
    return pool, log


def hold(pool, address: str, hashes: list[bytes]) -> None:
    """The pod caches the prompt and says so on its load stream (and to GetLoad)."""
    pool.pods[address].stub.held.update(hashes)
    keys = [block_key(h) for h in hashes]
    pool.prefix_index.apply(address, epb.PrefixCacheKeys(stored=keys), 512)


@pytest.mark.parametrize("size", [4, 256])
def test_pushed_routing_asks_no_pod_and_follows_each_conversation(size):
    async def run():
        pool, log = pushed_fleet(PUSHED, size)
        router = Router(pool, PUSHED, pool.admission_config, BLOCK)
        asked, stayed = [], []
        for conversation in range(30):
            first, rpcs = await route(router, log, prompt(conversation, 4))
            asked += rpcs
            hold(pool, first[0].pod.address, prompt(conversation, 4))
            second, rpcs = await route(router, log, prompt(conversation, 7))
            asked += rpcs
            stayed.append(second[0].pod is first[0].pod and second[0].matched_blocks == 4)
        return asked, stayed

    asked, stayed = asyncio.run(run())
    assert asked == []
    assert all(stayed)


def test_a_conversation_off_the_ring_is_found_by_its_holder():
    async def run():
        pool, log = pushed_fleet(PUSHED, 64)
        hashes = prompt(5, 8)
        owner = deepest_ladder_owner(hashes, list(pool.pods))
        elsewhere = next(a for a in pool.pods if a != owner)  # where a busy moment sent it
        hold(pool, elsewhere, hashes)
        pushed = Router(pool, PUSHED, pool.admission_config, BLOCK)
        queried = Router(pool, RouterConfig(policy="bounded"), pool.admission_config, BLOCK)
        ranked, _ = await route(pushed, log, prompt(5, 12))
        unseen, _ = await route(queried, log, prompt(5, 12))
        return ranked[0], unseen[0], elsewhere

    pushed_best, query_best, elsewhere = asyncio.run(run())
    assert (pushed_best.pod.address, pushed_best.matched_blocks) == (elsewhere, 8)
    # Asking only the ring's and the load candidates misses it (the case the holders are for).
    assert query_best.pod.address != elsewhere


def ranking(ranked) -> list[tuple[str, int]]:
    return [(s.pod.address, s.matched_blocks) for s in ranked]


def test_pushed_score_ranks_as_the_queries_do():
    async def run():
        pool, log = pushed_fleet(RouterConfig(prefix_match="pushed"), 16)
        for i, address in enumerate(pool.pods):
            hold(pool, address, prompt(i % 5, 1 + i % 9))
        pushed = Router(pool, RouterConfig(prefix_match="pushed"), pool.admission_config, BLOCK)
        queried = Router(pool, RouterConfig(), pool.admission_config, BLOCK)
        pairs = []
        for conversation in range(5):
            a, asked_pushed = await route(pushed, log, prompt(conversation, 10))
            b, asked_query = await route(queried, log, prompt(conversation, 10))
            pairs.append((ranking(a), ranking(b), asked_pushed, len(asked_query)))
        return pairs

    for pushed_rank, query_rank, asked_pushed, asked_query in asyncio.run(run()):
        assert pushed_rank == query_rank
        assert asked_pushed == [] and asked_query == 16


@pytest.mark.parametrize("router, message", [
    ({"prefix_match": "gossip"}, "router.prefix_match: 'gossip' is not one of"),
    ({"holder_candidates": -1}, "router.holder_candidates must be in [0, 16]"),
    ({"holder_candidates": 17}, "router.holder_candidates must be in [0, 16]"),
    ({"max_pushed_blocks_per_pod": 0}, "router.max_pushed_blocks_per_pod must be >= 1"),
])
def test_pushed_knobs_are_validated(router, message):
    with pytest.raises(GatewayConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        gateway_config_from_dict({**BASE, "router": router})


@pytest.mark.parametrize("backlog, holder_wins", [(0, True), (16 * BLOCK, True), (24 * BLOCK, False)])
def test_a_holder_wins_while_its_backlog_is_under_twice_what_its_cache_saves(backlog, holder_wins):
    """A 16-block prompt of which one pod caches 10 blocks (160 tokens saved)
    while the other pods are idle and cold: at the default weights the holder
    keeps it until the tokens it must prefill first (its report's backlog)
    pass twice the saving, where the request's first token comes much sooner
    on a cold pod. Before the backlog term, a holder won whatever queued there."""
    async def run():
        pool, log = pushed_fleet(PUSHED, 16)
        hashes = prompt(9, 16)
        holder = deepest_ladder_owner(hashes, list(pool.pods))
        hold(pool, holder, hashes[:10])
        pool.pods[holder].load.num_pending_prefill_tokens = backlog
        ranked, _ = await route(Router(pool, PUSHED, pool.admission_config, BLOCK), log, hashes)
        return ranked[0].pod.address, holder

    best, holder = asyncio.run(run())
    assert (best == holder) is holder_wins

