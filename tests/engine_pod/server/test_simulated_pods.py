"""`tessera engine --simulate PROFILE --simulated-pods N`: N pods in one
process with the real scheduler and KV cache manager, serving the same
Engine API, health, load reports and metrics as a real pod, with the
deterministic tokens of engine_pod/sim/tokens.py and without torch (the
process makes torch unimportable, so any path that needs it fails here)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine_pod.server.process import SimulatedPodsProcess, health_status
from engine_pod.sim.step_profile import StepFeatures, StepTimeProfile
from engine_pod.sim.tokens import simulated_output
from kv_store.block_hash import hash_request_tokens
from tessera.text import load_eos_token_ids
from tests.engine_pod.server.client import generate_all, greedy, load, scrape_metrics

PROFILE = "engine_pod/sim/profiles/bench-cpu.json"
NUM_PODS = 3
POD_ARGS = ["--max-model-len", "256", "--num-gpu-blocks", "64", "--drain-timeout", "5"]


@pytest.fixture(scope="module")
def sim_pods(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("sim") / "pods.log"
    with SimulatedPodsProcess(tiny_llama, PROFILE, NUM_PODS, POD_ARGS, log_path=log) as pods:
        pods.wait_serving()
        yield pods


def test_every_pod_serves_the_prompts_own_tokens(sim_pods, tiny_llama):
    eos = load_eos_token_ids(tiny_llama)
    prompts = [list(range(10 + i, 50 + i)) for i in range(4)]
    for address in sim_pods.addresses:
        results = asyncio.run(generate_all(address, [greedy(p, 6, ignore_eos=True) for p in prompts]))
        assert [tokens for tokens, _ in results] == [simulated_output(p, 6, 8192, eos) for p in prompts]
        assert {reason for _, reason in results} == {"length"}


def test_steps_take_the_profiles_time(sim_pods):
    """6 tokens of a 40-token prompt: one prefill step of 40 tokens, then
    five steps decoding one sequence over a growing context; the request
    takes their predicted sum (plus the scheduler, the server and gRPC)."""
    profile = StepTimeProfile.load(PROFILE)
    predicted = profile.predict(StepFeatures(40, 0, 0))
    predicted += sum(profile.predict(StepFeatures(0, 1, 40 + i)) for i in range(5))
    start = time.monotonic()
    asyncio.run(generate_all(sim_pods.addresses[0], [greedy(list(range(900, 940)), 6, ignore_eos=True)]))
    elapsed = time.monotonic() - start
    assert predicted < elapsed < predicted + 1.0, (elapsed, predicted)


def test_load_reports_count_the_prefix_cache_and_the_pool(sim_pods):
    address = sim_pods.addresses[1]
    prompt = list(range(2000, 2064))  # four full blocks
    asyncio.run(generate_all(address, [greedy(prompt, 2)]))
    report = load(address, hash_request_tokens(prompt, 16))
    assert report.serving and report.num_kv_blocks == 64 and report.block_size == 16
    assert report.matched_prefix_blocks == 4
    assert load(sim_pods.addresses[2], hash_request_tokens(prompt, 16)).matched_prefix_blocks == 0


def test_load_reports_carry_the_prefill_backlog_while_a_prompt_prefills(sim_pods):
    """A 200-token prompt prefills in one step of about half a second (the profile's 2.6 ms a token):
    a report read during that step counts its tokens; once it decodes, none are left."""
    address = sim_pods.addresses[0]

    async def run():
        task = asyncio.create_task(generate_all(address, [greedy(list(range(4000, 4200)), 3, ignore_eos=True)]))
        seen = []
        while not task.done():
            seen.append(await asyncio.to_thread(lambda: load(address).num_pending_prefill_tokens))
            await asyncio.sleep(0.02)
        await task
        return seen

    seen = asyncio.run(run())
    assert max(seen) >= 190, seen
    assert load(address).num_pending_prefill_tokens == 0


def test_metrics_and_health_per_pod(sim_pods):
    asyncio.run(generate_all(sim_pods.addresses[2], [greedy([5, 6, 7], 3)]))
    samples = scrape_metrics(SimpleNamespace(metrics_port=sim_pods.metrics_ports[2]))
    assert samples[("tessera_generation_tokens_total", ())] >= 3
    assert all(health_status(a) == health_pb2.HealthCheckResponse.SERVING for a in sim_pods.addresses)


def test_request_seconds_in_flight_add_up_the_requests_lifetimes(sim_pods):
    """Four requests of a few decode steps each, at once: the pod's counter
    grows by about the sum of their times in the engine, which the end-to-end
    histogram (arrival at the gRPC handler to its end) bounds from above."""
    port = SimpleNamespace(metrics_port=sim_pods.metrics_ports[1])
    key, e2e = ("tessera_request_in_flight_seconds_total", ()), ("tessera_e2e_request_latency_seconds_sum", ())
    before = scrape_metrics(port)
    asyncio.run(generate_all(sim_pods.addresses[1], [greedy(list(range(300 + i, 340 + i)), 8, ignore_eos=True)
                                                     for i in range(4)]))
    after = scrape_metrics(port)
    grew, lifetimes = after[key] - before[key], after[e2e] - before[e2e]
    assert 0.7 * lifetimes < grew <= lifetimes + 0.01, (grew, lifetimes)
    time.sleep(0.3)
    assert scrape_metrics(port)[key] == pytest.approx(after[key]), "nothing in flight: the counter stands still"


@pytest.mark.parametrize("params, field", [({"logprobs": 1}, "logprobs")])
def test_what_a_simulation_cannot_honour_is_invalid_argument(sim_pods, params, field):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(generate_all(sim_pods.addresses[0], [greedy([1, 2, 3], 2, **params)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_sigterm_drains_every_pod_and_exits_zero(tiny_llama, tmp_path):
    with SimulatedPodsProcess(tiny_llama, PROFILE, 2, POD_ARGS, log_path=tmp_path / "log") as pods:
        pods.wait_serving()
        assert pods.terminate() == 0
    assert (tmp_path / "log").read_text().count("tessera engine ready: simulated") == 2


@pytest.mark.parametrize("flags, message", [
    (["--simulated-pods", "2"], "only with --simulate"),
    (["--simulate", PROFILE, "--simulated-pods", "0"], "simulated_pods must be >= 1"),
    (["--simulate", PROFILE, "--simulated-pods", "4", "--grpc-port", "9000", "--metrics-port", "9002"], "overlap"),
    (["--simulate", "no-such-profile.json"], "cannot read the profile"),
    (["--simulate", PROFILE, "--dtype", "bfloat16"], "dtype"),
])
def test_bad_simulation_flags_fail_with_the_reason(tiny_llama, flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "tessera_tools.cli", "engine", "--model", str(tiny_llama), "--no-internal-auth",
         "--host", "127.0.0.1", *flags],
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr + result.stdout
