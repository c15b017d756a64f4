"""The bounded routing policy (gateway/router.py): a fixed number of prefix
queries per request whatever the fleet size, the same candidates on every
gateway replica, and a conversation's next turn looking where its last turn
went.

Pods are routable Pod objects without engines (tests/gateway/test_router.py's
pool); their Engine stub is a stand-in that answers GetLoad from the prompts
routed to it and logs each call, so a test counts the RPCs of 256 pods in one
process. The metric test and the unreachable pod use real gRPC on loopback.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from gateway.config import GatewayConfigError, RouterConfig, gateway_config_from_dict
from gateway.metrics import GatewayMetrics
from gateway.pods import Pod, PodPool
from gateway.hash_ring import HashRing
from gateway.router import BOUNDED_FALLBACKS, Router, ScoredPod, affinity_candidates
from kv_store.block_hash import hash_request_tokens
from tessera.v1 import engine_pb2 as epb
from tessera.v1 import engine_pb2_grpc as epb_grpc
from tests.gateway.test_router import _serving_pool

BLOCK = 16
BOUNDED = RouterConfig(policy="bounded")  # 2 affinity + 2 load candidates
K = BOUNDED.affinity_candidates + BOUNDED.load_candidates


def leading_held(held: set[bytes], block_hashes) -> int:
    """What a pod's prefix cache answers: the leading blocks it holds."""
    matched = 0
    for h in block_hashes:
        if h not in held:
            break
        matched += 1
    return matched


class PrefixCacheStub:
    """Stands in for a pod's Engine stub: GetLoad answers from the prompts
    the test says the pod served, with the pod's pushed load unless the test
    sets the load as of now (`current`); every call is logged."""

    def __init__(self, pod: Pod, log: list[str]) -> None:
        self.pod = pod
        self.log = log
        self.held: set[bytes] = set()
        self.current: epb.LoadReport | None = None

    async def GetLoad(self, request: epb.LoadRequest, timeout: float | None = None) -> epb.LoadReport:
        self.log.append(self.pod.address)
        answer = epb.LoadReport()
        answer.CopyFrom(self.current or self.pod.load)
        answer.matched_prefix_blocks = leading_held(self.held, request.block_hashes)
        return answer


def addresses(n: int) -> list[str]:
    return [f"10.0.{i // 200}.{i % 200 + 1}:50061" for i in range(n)]


def fleet(config: RouterConfig, pod_addresses: list[str]) -> tuple[PodPool, list[str]]:
    """A routable pool whose pods answer through PrefixCacheStubs, and the log of their calls."""
    pool = _serving_pool(config, pod_addresses)
    log: list[str] = []
    for pod in pool.pods.values():
        pod.stub = PrefixCacheStub(pod, log)
    return pool, log


def prompt(conversation: int, blocks: int) -> list[bytes]:
    """The chained block hashes of a conversation's first `blocks` blocks:
    a later turn's prompt extends an earlier one."""
    tokens = [conversation * 100_003 + i for i in range(blocks * BLOCK)]
    return hash_request_tokens(tokens, BLOCK)


async def route(router: Router, log: list[str], hashes: list[bytes]) -> tuple[list[ScoredPod], list[str]]:
    """One request's ranking and the pods it asked."""
    log.clear()
    ranked = await router.rank("mixed", hashes, len(hashes) * BLOCK, hashes[0] if hashes else b"short")
    return ranked, list(log)


def serve(ranked: list[ScoredPod], hashes: list[bytes]) -> Pod:
    """The first pod takes the request and caches its prompt."""
    pod = ranked[0].pod
    pod.stub.held.update(hashes)
    return pod


def deepest_ladder_owner(hashes: list[bytes], pod_addresses: list[str]) -> str:
    """The ring owner (tests/gateway/test_hash_ring.py checks the ring) of the deepest power-of-two depth."""
    depth = 2 ** (len(hashes).bit_length() - 1)
    return HashRing(sorted(pod_addresses)).owner(hashes[depth - 1])


def ring_of(pods: list[Pod]) -> HashRing:
    return HashRing([p.address for p in pods])


@pytest.mark.parametrize("size", [4, 64, 256])
def test_prefix_queries_per_request_are_bounded_whatever_the_pool_size(size):
    async def run() -> tuple[list[int], list[int], int]:
        pool, log = fleet(BOUNDED, addresses(size))
        router = Router(pool, BOUNDED, pool.admission_config, BLOCK)
        asked_counts, ranked_lengths = [], []
        for conversation in range(40):
            ranked, asked = await route(router, log, prompt(conversation, 1 + conversation % 37))
            assert len(set(asked)) == len(asked)
            asked_counts.append(len(asked))
            ranked_lengths.append(len({s.pod.address for s in ranked}))
        score_router = Router(pool, RouterConfig(), pool.admission_config, BLOCK)
        _, score_asked = await route(score_router, log, prompt(0, 8))
        await pool.close()
        return asked_counts, ranked_lengths, len(score_asked)

    asked_counts, ranked_lengths, score_asked = asyncio.run(run())
    assert max(asked_counts) <= min(K, size)
    assert max(asked_counts) == min(K, size)  # the budget is used, not skipped
    # The candidates, then up to BOUNDED_FALLBACKS un-asked pods as retry fallbacks; never all 256.
    assert all(min(size, 1 + BOUNDED_FALLBACKS) <= n <= min(size, K + BOUNDED_FALLBACKS) for n in ranked_lengths)
    assert score_asked == size  # what `score` costs on the same pool


def test_two_replicas_choose_the_same_candidates():
    """Two gateways, each with its own pool (pods listed in opposite orders)
    and the same pushed loads, ask the same pods and rank alike."""
    pod_addresses = addresses(64)

    async def replica(order: list[str]) -> list[tuple[list[str], list[str]]]:
        pool, log = fleet(BOUNDED, order)
        for i, address in enumerate(pod_addresses):
            pool.pods[address].load.num_waiting = i % 3
            pool.pods[address].load.num_running = i % 5
        router = Router(pool, BOUNDED, pool.admission_config, BLOCK)
        decisions = []
        for conversation in range(30):
            ranked, asked = await route(router, log, prompt(conversation, 1 + conversation))
            decisions.append((sorted(asked), [s.pod.address for s in ranked]))
        await pool.close()
        return decisions

    first = asyncio.run(replica(pod_addresses))
    second = asyncio.run(replica(pod_addresses[::-1]))
    assert first == second


def test_a_later_turn_keeps_the_earlier_turns_pod_as_a_candidate():
    """Turn 2 extends turn 1 (at most doubling it): the pod turn 1 went to
    (its deepest ladder owner) is asked again, holds turn 1, and wins."""
    pod_addresses = addresses(64)

    async def run() -> None:
        pool, log = fleet(BOUNDED, pod_addresses)
        router = Router(pool, BOUNDED, pool.admission_config, BLOCK)
        for conversation in range(40):
            n1 = 1 + conversation % 23
            turn1, turn2 = prompt(conversation, n1), prompt(conversation, 2 * n1)
            first = serve((await route(router, log, turn1))[0], turn1)
            assert affinity_candidates(turn1, pool.routable(), ring_of(pool.routable()), 2)[0] is first
            ranked, asked = await route(router, log, turn2)
            owners = affinity_candidates(turn2, pool.routable(), ring_of(pool.routable()), 2)
            assert first.address in [p.address for p in owners]
            assert first.address in asked
            assert ranked[0].pod is first and ranked[0].matched_blocks == n1
        await pool.close()

    asyncio.run(run())


def test_a_growing_conversation_moves_rarely():
    """64 turns, one block longer each, on the ladder alone (no load
    candidates): with 2 affinity candidates the conversation moves (a full
    prefill, or a partial one where an older pod of it owns a depth) only
    when its deepest ladder depth has grown fourfold since it was placed:
    turns 1, 4, 16 and 64 at most; every other turn finds all of the
    previous one cached."""
    config = RouterConfig(policy="bounded", load_candidates=0)

    async def run() -> list[int]:
        pool, log = fleet(config, addresses(64))
        router = Router(pool, config, pool.admission_config, BLOCK)
        misses = []
        for blocks in range(1, 65):
            hashes = prompt(7, blocks)
            ranked, _ = await route(router, log, hashes)
            if ranked[0].matched_blocks < blocks - 1:  # less than all of the previous turn
                misses.append(blocks)
            serve(ranked, hashes)
        await pool.close()
        return misses

    misses = asyncio.run(run())
    assert set(misses) <= {4, 16, 64}  # turn 1 has nothing to find


def test_with_no_pod_holding_the_prefix_the_deepest_ladder_owner_wins():
    pod_addresses = addresses(64)

    async def run() -> list[tuple[str, str, int]]:
        pool, log = fleet(BOUNDED, pod_addresses)
        router = Router(pool, BOUNDED, pool.admission_config, BLOCK)
        results = []
        for conversation in range(50):
            hashes = prompt(conversation, 1 + conversation % 40)
            ranked, _ = await route(router, log, hashes)
            results.append((ranked[0].pod.address, deepest_ladder_owner(hashes, pod_addresses),
                            ranked[0].matched_blocks))
        await pool.close()
        return results

    for chosen, deepest_owner, matched in asyncio.run(run()):
        assert (chosen, matched) == (deepest_owner, 0)


@pytest.mark.parametrize("running, waiting, owner_wins", [
    (2, 0, True),   # a report one or two requests stale: still the owner (affinity_bonus)
    (0, 1, True),   # one more waiting request: 0.0625 < 0.1
    (0, 2, False),  # two more: 0.125 > 0.1, the idle load candidate takes the new prefix
])
def test_a_new_prefix_goes_to_its_owner_unless_it_is_clearly_busier(running, waiting, owner_wins):
    pod_addresses = addresses(16)
    hashes = prompt(7, 8)
    owner = deepest_ladder_owner(hashes, pod_addresses)

    config = RouterConfig(policy="bounded", affinity_candidates=1, load_candidates=2)

    async def run() -> str:
        pool, log = fleet(config, pod_addresses)
        report = pool.pods[owner].load
        report.num_running, report.num_waiting = running, waiting
        ranked, _ = await route(Router(pool, config, pool.admission_config, BLOCK), log, hashes)
        await pool.close()
        return ranked[0].pod.address

    assert (asyncio.run(run()) == owner) is owner_wins


def test_a_candidate_holding_the_prefix_beats_one_that_does_not():
    """Whichever of the other candidates (the second affinity one, a load
    one) holds the prompt outranks the deepest owner, which holds nothing."""
    hashes = prompt(3, 12)

    async def run() -> list[tuple[str, str]]:
        pool, log = fleet(BOUNDED, addresses(64))
        router = Router(pool, BOUNDED, pool.admission_config, BLOCK)
        ranked, asked = await route(router, log, hashes)
        assert len(asked) == K and ranked[0].pod.address == asked[0]
        winners = []
        for holder in asked[1:]:
            for pod in pool.pods.values():
                pod.stub.held = set(hashes[:10]) if pod.address == holder else set()
            ranked, _ = await route(router, log, hashes)
            winners.append((holder, ranked[0].pod.address))
            assert ranked[0].matched_blocks == 10
        await pool.close()
        return winners

    for holder, winner in asyncio.run(run()):
        assert winner == holder


@pytest.mark.parametrize("pushed, current, holder_wins", [
    (200, 0, True),    # the report still counts the prompt prefilled since; the answer does not
    (0, 200, False),   # the answer's backlog is twice what the cache saves: the idle pod starts sooner
])
def test_the_prefix_answer_s_backlog_replaces_the_pushed_one(pushed, current, holder_wins):
    """A pod holding 64 of a 96-token prompt, its score from its answer to
    the prefix query, not from a report up to an interval old."""
    hashes = prompt(5, 6)
    config = RouterConfig(policy="bounded", affinity_candidates=1, load_candidates=1)

    async def run() -> tuple[str, str]:
        pool, log = fleet(config, addresses(16))
        router = Router(pool, config, pool.admission_config, BLOCK)
        _, asked = await route(router, log, hashes)
        holder = pool.pods[asked[0]]
        holder.stub.held = set(hashes[:4])
        holder.load.num_pending_prefill_tokens = pushed
        holder.stub.current = epb.LoadReport(serving=True, num_pending_prefill_tokens=current)
        ranked, asked_again = await route(router, log, hashes)
        await pool.close()
        assert asked_again == asked
        return holder.address, ranked[0].pod.address

    holder, winner = asyncio.run(run())
    assert (winner == holder) is holder_wins


def _loaded_fleet(config: RouterConfig) -> tuple[PodPool, list[str]]:
    """16 pods, busy but for c:1 then b:1 (d:1's one unreported dispatch counts)."""
    pool, log = fleet(config, addresses(12) + ["a:1", "b:1", "c:1", "d:1"])
    for pod in pool.pods.values():
        pod.load.num_waiting = 2
    loads = {"a:1": (0, 3, 0.0), "b:1": (0, 1, 0.5), "c:1": (0, 1, 0.2), "d:1": (0, 0, 0.0)}
    for address, (waiting, running, kv) in loads.items():
        report = pool.pods[address].load
        report.num_waiting, report.num_running, report.kv_cache_usage = waiting, running, kv
    pool.pods["d:1"].dispatched_since_report = 1
    return pool, log


def test_load_candidates_are_the_least_loaded():
    async def run(config: RouterConfig, hashes: list[bytes]) -> tuple[list[str], list[str]]:
        pool, log = _loaded_fleet(config)
        ranked, asked = await route(Router(pool, config, pool.admission_config, BLOCK), log, hashes)
        await pool.close()
        return [s.pod.address for s in ranked], asked

    # No affinity candidates: the pods asked are the two least loaded.
    _, asked = asyncio.run(run(RouterConfig(policy="bounded", affinity_candidates=0), prompt(1, 4)))
    assert asked == ["c:1", "b:1"]
    # A prompt shorter than a block: no RPC, the least loaded lead.
    ranked, asked = asyncio.run(run(BOUNDED, []))
    assert asked == [] and ranked[:2] == ["c:1", "b:1"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_candidate_is_ejected_and_the_request_still_ranks():
    """The deepest owner's address refuses connections (a real channel):
    its query fails UNAVAILABLE, it is ejected and left out; the others rank."""
    dead = f"127.0.0.1:{_closed_port()}"
    pod_addresses = addresses(7) + [dead]
    # Long enough that the refused connection, not the deadline, ends the query.
    config = RouterConfig(policy="bounded", prefix_query_timeout_ms=5000)
    conversation = next(c for c in range(1000) if deepest_ladder_owner(prompt(c, 5), pod_addresses) == dead)
    hashes = prompt(conversation, 5)

    async def run() -> tuple[list[str], bool, GatewayMetrics]:
        pool, log = fleet(config, pod_addresses)
        pool.pods[dead].stub = epb_grpc.EngineStub(pool.pods[dead].channel)
        metrics = GatewayMetrics()
        ranked, _ = await route(Router(pool, config, pool.admission_config, BLOCK, metrics), log, hashes)
        routable = pool.pods[dead].routable
        await pool.close()
        return [s.pod.address for s in ranked], routable, metrics

    ranked, routable, metrics = asyncio.run(run())
    assert not routable and dead not in ranked
    assert sorted(ranked) == sorted(addresses(7))
    assert metrics.registry.get_sample_value("tessera_gateway_prefix_queries_total", {"outcome": "unavailable"}) == 1
    assert metrics.registry.get_sample_value("tessera_gateway_prefix_queries_total", {"outcome": "ok"}) == K - 1


class PrefixServicer(epb_grpc.EngineServicer):
    """A real gRPC Engine that answers only GetLoad, counting the calls."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.calls = 0

    async def GetLoad(self, request: epb.LoadRequest, context: grpc.aio.ServicerContext) -> epb.LoadReport:
        self.calls += 1
        return epb.LoadReport(matched_prefix_blocks=leading_held(self.held, request.block_hashes))


def test_prefix_query_metric_counts_every_rpc_on_real_pods():
    """Four real loopback servers: the counter equals the GetLoad calls they
    received, 2 per request under bounded(1 + 1), 4 under score."""
    requests = 5

    async def run() -> tuple[float, int, float, int, int]:
        servicers, servers, pod_addresses = [], [], []
        for _ in range(4):
            server, servicer = grpc.aio.server(), PrefixServicer()
            epb_grpc.add_EngineServicer_to_server(servicer, server)
            pod_addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
            servicers.append(servicer)
        bounded = RouterConfig(policy="bounded", affinity_candidates=1, load_candidates=1,
                               prefix_query_timeout_ms=5000)
        pool = _serving_pool(bounded, pod_addresses)
        hashes = prompt(11, 6)
        servicers[pod_addresses.index(deepest_ladder_owner(hashes, pod_addresses))].held.update(hashes)
        counts = []
        for config in (bounded, RouterConfig(prefix_query_timeout_ms=5000)):
            metrics = GatewayMetrics()
            router = Router(pool, config, pool.admission_config, BLOCK, metrics)
            for servicer in servicers:
                servicer.calls = 0
            for _ in range(requests):
                ranked = await router.rank("mixed", hashes, len(hashes) * BLOCK, hashes[0])
                assert ranked[0].matched_blocks == 6 and len(ranked) == 4
            sent = metrics.registry.get_sample_value("tessera_gateway_prefix_queries_total", {"outcome": "ok"})
            counts += [sent, sum(s.calls for s in servicers)]
        await pool.close()
        for server in servers:
            await server.stop(None)
        return (*counts, requests)

    bounded_sent, bounded_received, score_sent, score_received, n = asyncio.run(run())
    assert bounded_sent == bounded_received == 2 * n
    assert score_sent == score_received == 4 * n


BASE = {"model": {"name": "m", "path": "/m"}, "pods": {"static": [{"address": "127.0.0.1:1"}]}}


def test_bounded_is_a_policy_with_defaults_and_score_stays_the_default():
    assert gateway_config_from_dict(BASE).router.policy == "score"
    router = gateway_config_from_dict({**BASE, "router": {"policy": "bounded"}}).router
    assert (router.policy, router.affinity_candidates, router.load_candidates) == ("bounded", 2, 2)
    router = gateway_config_from_dict({**BASE, "router": {"policy": "bounded", "affinity_candidates": 0}}).router
    assert (router.affinity_candidates, router.load_candidates) == (0, 2)


@pytest.mark.parametrize("router,message", [
    ({"affinity_candidates": -1}, r"router.affinity_candidates must be in \[0, 16\]"),
    ({"affinity_candidates": 17}, r"router.affinity_candidates must be in \[0, 16\]"),
    ({"affinity_candidates": "two"}, "router.affinity_candidates: expected int"),
    ({"load_candidates": -1}, "router.load_candidates must be >= 0"),
    ({"load_candidates": 1.5}, "router.load_candidates: expected int"),
    ({"affinity_candidates": 0, "load_candidates": 0}, "router.affinity_candidates . router.load_candidates must be"),
    ({"affinity_bonus": -0.1}, "router.affinity_bonus must be >= 0"),
    ({"affinity_bonus": "high"}, "router.affinity_bonus: expected float"),
])
def test_bounded_knobs_are_validated(router, message):
    with pytest.raises(GatewayConfigError, match=message):
        gateway_config_from_dict({**BASE, "router": {"policy": "bounded", **router}})
