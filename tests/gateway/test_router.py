"""The router's pure parts: the score formula, the rendezvous tie-break, and
the round-robin policy's order (no engine pods: Pod objects with a load
report set by hand; their channels open lazily and are never used)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import (
    AdmissionConfig,
    GatewayConfigError,
    RouterConfig,
    RouterWeights,
    gateway_config_from_dict,
)
from gateway.pods import Pod, PodPool
from gateway.pods.pod import sanitized
from gateway.router import PodLoad, Router, score_pod, tie_break
from tessera.v1 import engine_pb2 as epb

IDLE = PodLoad(waiting=0, running=0, kv_usage=0.0)


def test_score_is_the_documented_formula():
    config = RouterConfig(weights=RouterWeights(prefix=1.0, waiting=0.5, running=0.2, kv_usage=0.3), running_norm=32)
    load = PodLoad(waiting=4, running=16, kv_usage=0.5)
    expected = 1.0 * 0.75 - 0.5 * 4 / 8 - 0.2 * 16 / 32 - 0.3 * 0.5
    assert score_pod(0.75, load, config, max_waiting=8, num_prompt_tokens=64) == pytest.approx(expected)


def test_cached_prefix_outweighs_a_little_load():
    config = RouterConfig()
    warm_busy = score_pod(0.9, PodLoad(waiting=2, running=4, kv_usage=0.5), config, max_waiting=8, num_prompt_tokens=64)
    cold_idle = score_pod(0.0, IDLE, config, max_waiting=8, num_prompt_tokens=64)
    assert warm_busy > cold_idle


def test_load_decides_when_no_pod_holds_the_prefix():
    config = RouterConfig()
    busy = score_pod(0.0, PodLoad(waiting=1, running=0, kv_usage=0.0), config, max_waiting=8, num_prompt_tokens=64)
    assert score_pod(0.0, IDLE, config, max_waiting=8, num_prompt_tokens=64) > busy


def test_tie_break_is_stable_small_and_spreads_keys():
    assert tie_break(b"key", "10.0.0.1:50061") == tie_break(b"key", "10.0.0.1:50061")
    assert 0 <= tie_break(b"key", "10.0.0.1:50061") < 1e-6
    # Different prompts prefer different pods (rendezvous hashing), not all the same one.
    pods = ["10.0.0.1:50061", "10.0.0.2:50061"]
    winners = {max(pods, key=lambda a: tie_break(bytes([k]), a)) for k in range(32)}
    assert winners == set(pods)


def _serving_pool(config: RouterConfig, addresses: list[str], role: str = "mixed") -> PodPool:
    """A pool whose pods are routable without any watcher or engine."""
    pool = PodPool(config, AdmissionConfig())
    for address in addresses:
        pod = Pod(address, role)
        pod.on_report(epb.LoadReport(role=role, serving=True))
        pool.pods[address] = pod
    return pool


def _rank_order(policy: str, rounds: int, loads: dict[str, int] | None = None) -> list[list[str]]:
    async def run() -> list[list[str]]:
        config = RouterConfig(policy=policy)
        pool = _serving_pool(config, ["a:1", "b:1", "c:1"])
        for address, waiting in (loads or {}).items():
            pool.pods[address].load.num_waiting = waiting
        router = Router(pool, config, AdmissionConfig(), block_size=16)
        orders = []
        for _ in range(rounds):
            # Block hashes are given: round robin must not query the pods for them.
            ranked = await router.rank("mixed", [b"h" * 32], 64, b"h" * 32)
            orders.append([s.pod.address for s in ranked])
        await pool.close()
        return orders

    return asyncio.run(run())


def test_round_robin_rotates_through_every_pod():
    orders = _rank_order("round_robin", 4)
    assert [o[0] for o in orders] == ["a:1", "b:1", "c:1", "a:1"]
    # The rest of each list are the retry fallbacks, in rotation order.
    assert orders[1] == ["b:1", "c:1", "a:1"]


def test_round_robin_ignores_load():
    orders = _rank_order("round_robin", 3, loads={"a:1": 8, "b:1": 0, "c:1": 0})
    assert [o[0] for o in orders] == ["a:1", "b:1", "c:1"]


def test_round_robin_skips_pods_that_are_not_routable():
    async def run() -> list[str]:
        config = RouterConfig(policy="round_robin")
        pool = _serving_pool(config, ["a:1", "b:1", "c:1"])
        pool.pods["b:1"].eject()
        router = Router(pool, config, AdmissionConfig(), block_size=16)
        firsts = [(await router.rank("mixed", [], 0, b"k"))[0].pod.address for _ in range(4)]
        await pool.close()
        return firsts

    assert asyncio.run(run()) == ["a:1", "c:1", "a:1", "c:1"]


def test_score_policy_without_prefix_prefers_the_least_loaded_pod():
    # No block hashes (a prompt shorter than a block): no prefix queries either.
    async def run() -> list[str]:
        config = RouterConfig()
        pool = _serving_pool(config, ["a:1", "b:1"])
        pool.pods["a:1"].load.num_waiting = 3
        router = Router(pool, config, AdmissionConfig(), block_size=16)
        ranked = await router.rank("mixed", [], 8, b"k")
        await pool.close()
        return [s.pod.address for s in ranked]

    assert asyncio.run(run()) == ["b:1", "a:1"]


def test_a_pod_reporting_less_than_idle_does_not_draw_every_request():
    """A faulty or hostile pod's negative counts and KV usage are clamped on
    arrival: it ties with an honest idle pod, and the tie-break spreads
    prompts over both (unclamped, it won every one)."""
    async def run() -> set[str]:
        config = RouterConfig()
        pool = _serving_pool(config, ["honest:1", "liar:1"])
        pool.pods["liar:1"].on_report(epb.LoadReport(
            role="mixed", serving=True, num_running=-1000, num_waiting=-50, kv_cache_usage=-5.0,
            num_pending_prefill_tokens=-10**12))
        router = Router(pool, config, AdmissionConfig(), block_size=16)
        firsts = {(await router.rank("mixed", [], 8, bytes([k]) * 8))[0].pod.address for k in range(32)}
        await pool.close()
        return firsts

    assert asyncio.run(run()) == {"honest:1", "liar:1"}


@pytest.mark.parametrize("usage, clamped", [(float("nan"), 1.0), (7.5, 1.0), (-0.5, 0.0), (0.25, 0.25)])
def test_reported_kv_usage_is_clamped_to_a_share(usage, clamped):
    report = sanitized(epb.LoadReport(kv_cache_usage=usage, num_running=3, matched_prefix_blocks=-2))
    assert report.kv_cache_usage == clamped
    assert (report.num_running, report.matched_prefix_blocks) == (3, 0)


def test_policy_is_validated_and_defaults_to_score():
    base = {"model": {"name": "m", "path": "/m"}, "pods": {"static": [{"address": "127.0.0.1:1"}]}}
    assert gateway_config_from_dict(base).router.policy == "score"
    rr = gateway_config_from_dict({**base, "router": {"policy": "round_robin"}})
    assert rr.router.policy == "round_robin"
    with pytest.raises(GatewayConfigError, match="router.policy"):
        gateway_config_from_dict({**base, "router": {"policy": "random"}})
