"""Scale from zero (issue 18): with admission.queue_without_pods, a gateway
with no engine pod takes requests into its queue instead of answering 503,
exports them as tessera_gateway_queue_length (which the operator's
autoscaler reads to lift a pool from zero: checked here on the gateway's
real metrics text), and the queued requests complete once the first pod
is ready. A simulated pod plays the pod that starts."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import httpx

from engine_pod.server.process import SimulatedPodsProcess
from engine_pod.sim.tokens import simulated_output
from gateway.process import GatewayProcess
from tessera.child_process import free_port_range
from tessera.text import load_eos_token_ids
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc
from tessera_operator.autoscale import PoolObservation, ScalerState, ScalingPolicy, decide
from tessera_operator.signals import gateway_demand, parse_gateway_queued
from tests.gateway.conftest import KEYS, MODEL_NAME, gateway_config, write_tenants

PROFILE = "engine_pod/sim/profiles/bench-cpu.json"
AUTH = (("authorization", f"Bearer {KEYS['alice']}"),)
PROMPTS = [[40 + 7 * i + j for j in range(20)] for i in range(3)]


def _gateway(tiny_llama, tmp_path, address: str, **admission) -> GatewayProcess:
    config = gateway_config(tiny_llama, [(SimpleNamespace(address=address), "mixed")],
                            write_tenants(tmp_path / "tenants.yaml"),
                            router={"load_interval_ms": 50, "reprobe_interval_s": 0.1}, admission=admission)
    return GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log")


def _wait_live(gw: GatewayProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gw.check_alive("gateway")
        try:
            if httpx.get(gw.base_url + "/health/live").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("gateway not answering")


async def _first_token_times(address: str) -> list[tuple[float, list[int]]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(prompt):
            first, tokens = None, []
            params = pb.GenerationParams(max_tokens=4, temperature=0, ignore_eos=True)
            async for chunk in stub.Complete(pb.CompletionRequest(model=MODEL_NAME, prompt_token_ids=prompt,
                                                                  params=params), metadata=AUTH, timeout=60):
                for choice in chunk.choices:
                    if choice.token_ids and first is None:
                        first = time.monotonic()
                    tokens.extend(choice.token_ids)
            return first, tokens

        return await asyncio.gather(*(one(p) for p in PROMPTS))


def test_requests_wait_for_the_first_pod_and_their_demand_lifts_the_pool(tiny_llama, tmp_path):
    port = free_port_range(1)
    with _gateway(tiny_llama, tmp_path, f"127.0.0.1:{port}", queue_without_pods=True, queue_timeout_s=30) as gw:
        gw.wait_ready(num_pods=0)
        assert httpx.get(gw.base_url + "/health").status_code == 503  # no pod routable ...
        assert httpx.get(gw.base_url + "/health/ready").status_code == 200  # ... but it takes requests
        assert httpx.get(gw.base_url + "/health/live").status_code == 200

        async def scenario():
            requests = asyncio.create_task(_first_token_times(gw.grpc_address))
            deadline = time.monotonic() + 10
            queued = 0
            while queued < len(PROMPTS) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                queued = parse_gateway_queued(httpx.get(gw.metrics_url).text)
            assert queued == len(PROMPTS) and not requests.done()
            # The operator's decision on that demand, for a pool at zero.
            policy = ScalingPolicy(signal="queue", target=4, min_replicas=0, max_replicas=3)
            observation = PoolObservation(replicas=0, ready=0, pending=0, signal=None, busy=False,
                                          gateway_queued=queued)
            decision = decide(policy, observation, ScalerState(), now=0.0)
            assert (decision.reason, decision.replicas) == ("ScaleFromZero", 1)
            started = time.monotonic()
            with SimulatedPodsProcess(tiny_llama, PROFILE, 1, ["--max-model-len", "256", "--num-gpu-blocks", "64"],
                                      log_path=tmp_path / "pod.log", grpc_port=port) as pod:
                pod.wait_serving()
                ready_after = time.monotonic() - started
                results = await requests
            return started, ready_after, results

        started, ready_after, results = asyncio.run(scenario())
        assert parse_gateway_queued(httpx.get(gw.metrics_url).text) == 0
    eos = load_eos_token_ids(tiny_llama)
    assert [tokens for _, tokens in results] == [simulated_output(p, 4, 8192, eos) for p in PROMPTS]
    # The first token within the pod's start-up plus 2 s (a prefill step and the gateway's reprobe).
    assert all(first - started <= ready_after + 2.0 for first, _ in results)


def test_without_queueing_no_pod_is_an_immediate_503(tiny_llama, tmp_path):
    port = free_port_range(1)
    with _gateway(tiny_llama, tmp_path, f"127.0.0.1:{port}") as gw:
        _wait_live(gw)
        assert httpx.get(gw.base_url + "/health/ready").status_code == 503
        start = time.monotonic()
        r = httpx.post(gw.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS['alice']}"},
                       json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_pod"
        assert time.monotonic() - start < 5


def test_a_request_admitted_as_the_last_pod_left_waits_for_the_next(tiny_llama):
    """Admission let it through while a pod was listed; by the time it is
    routed the pod is gone: with queue_without_pods it waits for a pod
    (within queue_timeout_s) instead of a 503."""
    from gateway.config import gateway_config_from_dict
    from gateway.main import build_gateway
    from gateway.pods import Pod
    from tessera.v1 import engine_pb2 as epb

    config = gateway_config_from_dict({
        "model": {"name": MODEL_NAME, "path": str(tiny_llama)}, "pods": {"static": [{"address": "127.0.0.1:1"}]},
        "router": {"policy": "round_robin"}, "admission": {"queue_without_pods": True, "queue_timeout_s": 5}})

    async def run():
        gateway = build_gateway(config)
        pod = Pod("127.0.0.1:2", "mixed")

        def arrives():
            pod.on_report(epb.LoadReport(role="mixed", serving=True))
            gateway.pool.pods[pod.address] = pod

        asyncio.get_running_loop().call_later(0.3, arrives)
        start = time.monotonic()
        plan = await gateway.plan(list(range(40)), "salt", "request-1")
        waited = time.monotonic() - start
        await gateway.close()
        return plan, waited

    plan, waited = asyncio.run(run())
    assert [p.address for p in plan.candidates] == ["127.0.0.1:2"] and 0.25 < waited < 2.0


def test_prompts_a_decode_pod_prefilled_for_want_of_a_prefill_pod_lift_the_prefill_pool(tiny_llama, tmp_path):
    """A prefill pool at zero beside serving decode pods: nothing queues, the decode pod prefills
    every prompt itself. The gateway counts the prompts that P/D would have sent to a prefill pod
    (tessera_gateway_prefills_unplaced), and the operator lifts the prefill pool on that count's rise."""
    long_prompt, short_prompt = list(range(100, 180)), list(range(100, 120))
    with SimulatedPodsProcess(tiny_llama, PROFILE, 1, ["--max-model-len", "256", "--num-gpu-blocks", "64",
                                                       "--role", "decode"], log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        config = gateway_config(tiny_llama, [(SimpleNamespace(address=pod.addresses[0]), "decode")],
                                write_tenants(tmp_path / "tenants.yaml"), disaggregation={"min_uncached_tokens": 48})
        with GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log") as gw:
            gw.wait_ready(num_pods=1)
            _, counters = gateway_demand({"gw": httpx.get(gw.metrics_url).text}, {})
            assert counters == {"gw": 0.0}

            async def send(prompt):
                async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
                    params = pb.GenerationParams(max_tokens=2, temperature=0, ignore_eos=True)
                    request = pb.CompletionRequest(model=MODEL_NAME, prompt_token_ids=prompt, params=params)
                    return [c async for c in pb_grpc.InferenceStub(channel).Complete(request, metadata=AUTH,
                                                                                     timeout=60)]

            assert asyncio.run(send(long_prompt)) and asyncio.run(send(short_prompt))  # both served
            demand, _ = gateway_demand({"gw": httpx.get(gw.metrics_url).text}, counters)
    assert (demand.queued, demand.prefills_unplaced) == (0, 1)  # the long prompt only
    policy = ScalingPolicy(signal="concurrency", target=1, min_replicas=0, max_replicas=3)
    at_zero = PoolObservation(replicas=0, ready=0, pending=0, signal=None, busy=False,
                              prefills_unplaced=demand.prefills_unplaced)
    decision = decide(policy, at_zero, ScalerState(), now=0.0)
    assert (decision.reason, decision.replicas) == ("ScaleFromZero", 1)
    assert "for want of a prefill pod" in decision.message
