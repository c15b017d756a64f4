"""Simulated engine pods (`tessera engine --simulate`) under the real
gateway, at small N: what the gateway sends and routes is checked against
the simulated pods' deterministic tokens, a killed host of pods is
routed around without losing a request, and split prefill and decode pools
hand prompts over through a real Redis. The big fleets (16-256 pods) are
`tessera bench fleet`'s."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from engine_pod.server.process import SimulatedPodsProcess
from engine_pod.sim.step_profile import StepTimeProfile
from engine_pod.sim.tokens import simulated_output
from gateway.process import GatewayProcess
from tessera.text import load_eos_token_ids
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.conftest import KEYS, MODEL_NAME, gateway_config, write_tenants
from tests.gateway.observe import metric_sum

SIM_ARGS = ["--max-model-len", "256", "--num-gpu-blocks", "128"]
AUTH = (("authorization", f"Bearer {KEYS['alice']}"),)


def _gateway(tiny_llama, tmp_path, addresses, **router):
    pods = [(SimpleNamespace(address=a), "mixed") for a in addresses]
    config = gateway_config(tiny_llama, pods, write_tenants(tmp_path / "tenants.yaml"),
                            router={"load_interval_ms": 50, **router})
    return GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log")


def _complete(stub, prompt: list[int], max_tokens: int) -> pb.CompletionResult:
    params = pb.GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return stub.CompleteUnary(pb.CompletionRequest(model=MODEL_NAME, prompt_token_ids=prompt, params=params),
                              metadata=AUTH, timeout=30)


def wait_for(predicate, timeout: float) -> bool:
    """Whether `predicate()` holds within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


PROMPTS = [[100 * g + i for i in range(96)] + [7000 + 10 * g + r] * 4 for g in range(4) for r in range(4)]


def _grouped_prefixes(tiny_llama, tmp_path, profile, index_blocks: int = 0,
                      **router) -> tuple[int, list[list[int]], float]:
    """Four prefixes of six blocks, four requests each, prefix after prefix
    (round robin then sends each prefix's requests to four different pods).
    Returns the cached tokens, the outputs and the prefix queries sent."""
    tmp_path.mkdir()
    with SimulatedPodsProcess(tiny_llama, profile, 4, SIM_ARGS, log_path=tmp_path / "pods.log") as pods:
        pods.wait_serving()
        # A generous prefix-query timeout: on two shared cores a 50 ms one
        # expires now and then, and this is about where the policies route.
        with _gateway(tiny_llama, tmp_path, pods.addresses, prefix_query_timeout_ms=2000, **router) as gw:
            gw.wait_ready(num_pods=4)
            with grpc.insecure_channel(gw.grpc_address) as channel:
                stub = pb_grpc.InferenceStub(channel)
                results = [_complete(stub, p, 3) for p in PROMPTS]
            queries = metric_sum(gw.metrics_url, "tessera_gateway_prefix_queries_total")
            # The distinct blocks the pods pushed (0 unless router.prefix_match is pushed), once the
            # last request's blocks have been pushed (a report every 50 ms).
            assert wait_for(lambda: metric_sum(gw.metrics_url, "tessera_gateway_pushed_prefix_blocks")
                            == index_blocks, timeout=5), metric_sum(gw.metrics_url,
                                                                    "tessera_gateway_pushed_prefix_blocks")
            # Every request's dispatch is timed once, in well under the 2 s the slowest bucket allows.
            assert metric_sum(gw.metrics_url, "tessera_gateway_dispatch_seconds_count") == len(PROMPTS)
            assert metric_sum(gw.metrics_url, "tessera_gateway_dispatch_seconds_bucket", le="1.0") == len(PROMPTS)
    return sum(r.usage.cached_tokens for r in results), [list(r.choices[0].token_ids) for r in results], queries


@pytest.fixture(scope="module")
def expected(tiny_llama):
    eos = load_eos_token_ids(tiny_llama)
    return lambda prompt, n: simulated_output(prompt, n, 8192, eos)


def test_the_scorer_keeps_each_prefix_on_one_pod_and_round_robin_does_not(tiny_llama, tmp_path, expected,
                                                                          fast_sim_profile):
    scored, outputs, queries = _grouped_prefixes(tiny_llama, tmp_path / "score", fast_sim_profile, policy="score")
    rotated, _, rotated_queries = _grouped_prefixes(tiny_llama, tmp_path / "rr", fast_sim_profile,
                                                    policy="round_robin")
    # Scored: each prefix's three later requests find its six blocks (96 tokens) cached.
    assert scored == 4 * 3 * 96
    assert rotated == 0
    assert outputs == [expected(p, 3) for p in PROMPTS]
    assert queries == 4 * len(PROMPTS) and rotated_queries == 0  # score asks every pod


def test_the_bounded_policy_finds_the_prefix_asking_two_pods(tiny_llama, tmp_path, expected, fast_sim_profile):
    cached, outputs, queries = _grouped_prefixes(tiny_llama, tmp_path / "bounded", fast_sim_profile, policy="bounded",
                                                 affinity_candidates=1, load_candidates=1)
    assert cached == 4 * 3 * 96
    assert outputs == [expected(p, 3) for p in PROMPTS]
    assert queries <= 2 * len(PROMPTS)


def test_pushed_prefix_caches_route_without_a_query(tiny_llama, tmp_path, expected, fast_sim_profile):
    """router.prefix_match pushed: the pods' load streams carry their caches,
    the gateway's index holds each prefix's six blocks (4 x 6 distinct
    blocks: 100 prompt + 3 output tokens fill six) and the warm-up block
    every pod caches at start (engine_pod/server/main.py), and no prefix
    query is sent."""
    for policy in ("bounded", "score"):
        cached, outputs, queries = _grouped_prefixes(tiny_llama, tmp_path / policy, fast_sim_profile,
                                                     policy=policy, prefix_match="pushed",
                                                     index_blocks=4 * 6 + 1)
        assert cached == 4 * 3 * 96
        assert outputs == [expected(p, 3) for p in PROMPTS]
        assert queries == 0


async def _stream(stub, prompt: list[int], max_tokens: int) -> dict:
    params = pb.GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outcome = {"tokens": [], "error": None}
    try:
        async for chunk in stub.Complete(pb.CompletionRequest(model=MODEL_NAME, prompt_token_ids=prompt,
                                                              params=params), metadata=AUTH, timeout=60):
            for choice in chunk.choices:
                outcome["tokens"].extend(choice.token_ids)
    except grpc.aio.AioRpcError as e:
        outcome["error"] = (e.code(), e.details())
    return outcome


@pytest.fixture(scope="module")
def slow_profile(tmp_path_factory):
    """Steps slow enough that the kill lands where the test wants it, whatever
    the shipped profile says: 70 ms a step plus 3.4 ms a prefill token."""
    path = tmp_path_factory.mktemp("profile") / "slow.json"
    StepTimeProfile(base_s=0.07, per_prefill_token_s=0.0034, per_decode_seq_s=0.0038, per_context_token_s=3e-6,
                    source="tests: slow steps").save(path)
    return path


def test_a_killed_host_of_pods_loses_no_request(tiny_llama, tmp_path, expected, slow_profile):
    """Half the fleet (one process of two pods) is SIGKILLed under load. A
    first wave is streaming when it dies: its requests there end with a
    clear UNAVAILABLE after the tokens they had (which are the right ones).
    A second wave has just arrived and streamed nothing (its prefill step
    is running): its requests there are retried on the survivors and
    complete. Requests after the kill all complete."""
    first = [[11 * i + j for j in range(24)] for i in range(16)]
    second = [[13 * i + j + 3000 for j in range(24)] for i in range(16)]
    with SimulatedPodsProcess(tiny_llama, slow_profile, 2, SIM_ARGS, log_path=tmp_path / "a.log") as a, \
            SimulatedPodsProcess(tiny_llama, slow_profile, 2, SIM_ARGS, log_path=tmp_path / "b.log") as b:
        a.wait_serving()
        b.wait_serving()
        with _gateway(tiny_llama, tmp_path, a.addresses + b.addresses, reprobe_interval_s=0.2) as gw:
            gw.wait_ready(num_pods=4)

            async def run() -> tuple[list[dict], list[dict], list[dict]]:
                async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
                    stub = pb_grpc.InferenceStub(channel)
                    # bench-cpu: the first wave's prefill step takes ~0.4 s a pod, then a token every ~0.09 s.
                    first_wave = [asyncio.create_task(_stream(stub, p, 40)) for p in first]
                    await asyncio.sleep(1.5)
                    second_wave = [asyncio.create_task(_stream(stub, p, 12)) for p in second]
                    await asyncio.sleep(0.15)
                    b.proc.kill()
                    done_first = await asyncio.gather(*first_wave)
                    done_second = await asyncio.gather(*second_wave)
                    after = await asyncio.gather(*(_stream(stub, p, 4) for p in first[:8]))
                    return done_first, done_second, after

            done_first, done_second, after = asyncio.run(run())
            retries = metric_sum(gw.metrics_url, "tessera_gateway_routing_decisions_total", kind="retry")
    cut = [o for o in done_first if o["error"] is not None]
    assert cut, "no first-wave request was on the killed pods"
    for o, p in zip(done_first, first):
        if o["error"] is None:
            assert o["tokens"] == expected(p, 40)
        else:
            assert o["error"][0] == grpc.StatusCode.UNAVAILABLE
            assert 0 < len(o["tokens"]) < 40 and o["tokens"] == expected(p, len(o["tokens"]))
    assert [o["error"] for o in done_second] == [None] * len(second)
    assert [o["tokens"] for o in done_second] == [expected(p, 12) for p in second]
    assert retries >= 1  # the second wave's requests on the killed pods went elsewhere
    assert [o["tokens"] for o in after] == [expected(p, 4) for p in first[:8]]


def test_simulated_pools_disaggregate_through_the_store(tiny_llama, tmp_path, expected, fast_sim_profile,
                                                        redis_server):
    """A simulated prefill pool and decode pool sharing a real Redis: the
    gateway prefills a long prompt on the first, the second loads its
    blocks from the store (cached tokens) and streams the prompt's own
    tokens; a short prompt stays on the decode pod alone."""
    store = SIM_ARGS + ["--kv-redis-url", redis_server.url]
    with SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, store + ["--role", "prefill"],
                              log_path=tmp_path / "prefill.log") as prefill, \
            SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, store + ["--role", "decode"],
                                 log_path=tmp_path / "decode.log") as decode:
        prefill.wait_serving()
        decode.wait_serving()
        pods = [(SimpleNamespace(address=prefill.addresses[0]), "prefill"),
                (SimpleNamespace(address=decode.addresses[0]), "decode")]
        config = gateway_config(tiny_llama, pods, write_tenants(tmp_path / "tenants.yaml"),
                                disaggregation={"min_uncached_tokens": 48})
        with GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log") as gw:
            gw.wait_ready(num_pods=2)
            long_prompt, short_prompt = list(range(1000, 1100)), list(range(2000, 2020))
            with grpc.insecure_channel(gw.grpc_address) as channel:
                stub = pb_grpc.InferenceStub(channel)
                long_out, short_out = _complete(stub, long_prompt, 6), _complete(stub, short_prompt, 6)
            prefilled = metric_sum(gw.metrics_url, "tessera_gateway_routing_decisions_total", role="prefill",
                                   kind="prefill")
        redis_hits = metric_sum(f"http://127.0.0.1:{decode.metrics_ports[0]}/metrics", "tessera_kv_store_hits_total",
                                tier="redis")
    assert list(long_out.choices[0].token_ids) == expected(long_prompt, 6)
    assert list(short_out.choices[0].token_ids) == expected(short_prompt, 6)
    assert prefilled == 1
    assert long_out.usage.cached_tokens == 6 * 16 and short_out.usage.cached_tokens == 0
    assert redis_hits == 6
