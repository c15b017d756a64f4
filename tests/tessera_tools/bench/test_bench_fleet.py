"""`tessera bench fleet`: the trace and the workload as pure functions, the
figures of a run from its measurements, the gateway path of a workload on
one simulated pod, and a tiny fleet end to end (4 simulated pods in one
process, one gateway, round robin against the KV-aware scorer)."""

from __future__ import annotations

import argparse
import json
import math
import urllib.request

import pytest

from engine_pod.sim.step_profile import StepTimeProfile
from engine_pod.sim.tokens import simulated_output
from tessera_tools.bench import fleet as fleet_bench
from tessera_tools.bench.fleet.capacity import (
    DECODE_BATCH, estimate_capacity, request_pod_seconds, request_pod_seconds_by_pool,
)
from tessera_tools.bench.fleet.fleet import (
    MODEL_NAME, FleetSettings, process_sizes, running_fleet, tenant_keys, write_tenants_file,
)
from tessera_tools.bench.fleet.measure import histogram_quantile
from tessera_tools.bench.fleet.replay import ReplayResult
from tessera_tools.bench.fleet.report import RunSpec, run_record
from tessera_tools.bench.fleet.runner import parse_slo_flag
from tessera_tools.bench.fleet.trace import build_trace, default_phases
from tessera_tools.bench.fleet.workload import (
    FIRST_PROMPT_ID, WorkloadSpec, build_requests, shared_prefix_requests, system_prompts,
)
from tessera_tools.bench.serve.stream import RequestOutcome

BLOCK = 16
# Small coefficients: a tiny fleet's steps take milliseconds, so the test is quick.
FAST_PROFILE = {"format_version": 1, "base_s": 0.004, "per_prefill_token_s": 4e-5, "per_decode_seq_s": 5e-4,
                "per_context_token_s": 0.0, "per_kv_byte_s": 0.0}
EOS = frozenset({1})


def spec(**overrides) -> WorkloadSpec:
    fields = {"tenants": 5, "vocab_size": 8192, "eos_token_ids": EOS, "max_model_len": 2048,
              "system_prompt_len": (100, 300), "user_len": (10, 40), "output_len": (4, 12), "think_s": 1.0}
    return WorkloadSpec(**{**fields, **overrides})


def steady_offsets(count: int, gap: float) -> list[float]:
    return [i * gap for i in range(count)]


# -- the trace ------------------------------------------------------------------------
def test_trace_ramps_holds_spikes_and_recovers():
    phases = default_phases(duration_s=200, rate=40, spike_factor=2.0)
    offsets = build_trace(phases, seed=3)
    assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] < 200
    assert [p.name for p in phases] == ["ramp"] * 4 + ["steady", "spike", "steady"]
    assert all(a.end_s == pytest.approx(b.start_s) for a, b in zip(phases, phases[1:]))

    def rate_in(start: float, end: float) -> float:
        return sum(start <= t < end for t in offsets) / (end - start)

    ramp = [rate_in(p.start_s, p.end_s) for p in phases[:4]]
    assert ramp == sorted(ramp) and ramp[0] == pytest.approx(10, rel=0.25) and ramp[3] == pytest.approx(40, rel=0.2)
    steady = rate_in(40, 120)
    assert steady == pytest.approx(40, rel=0.1)
    assert rate_in(120, 140) / steady == pytest.approx(2.0, rel=0.15)  # the spike
    assert rate_in(140, 200) == pytest.approx(40, rel=0.1)  # back to steady
    expected = sum(p.expected_requests for p in phases)
    assert len(offsets) == pytest.approx(expected, rel=0.05)


def test_trace_is_seeded():
    phases = default_phases(30, 5)
    assert build_trace(phases, seed=1) == build_trace(phases, seed=1)
    assert build_trace(phases, seed=1) != build_trace(phases, seed=2)


# -- the workload ---------------------------------------------------------------------
def test_each_turn_extends_the_previous_prompt_and_its_simulated_output():
    s = spec()
    requests = shared_prefix_requests(s, steady_offsets(400, 0.05), seed=0)
    later_turns = [r for r in requests if r.after is not None]
    assert len(later_turns) > 100 and max(r.turn for r in requests) >= 3
    for r in later_turns:
        prev = requests[r.after]
        history = prev.prompt_token_ids + simulated_output(prev.prompt_token_ids, prev.output_len, s.vocab_size, EOS)
        assert r.prompt_token_ids[:len(history)] == history
        assert len(r.prompt_token_ids) >= len(history) + s.user_len[0]
        assert (r.tenant, r.conversation, r.turn) == (prev.tenant, prev.conversation, prev.turn + 1)
        assert r.arrival_s >= prev.arrival_s + s.think_s
    systems = system_prompts(s, seed=0)
    for r in requests:
        assert r.prompt_token_ids[:len(systems[r.tenant])] == systems[r.tenant]
        assert len(r.prompt_token_ids) + r.output_len <= s.max_model_len
        assert s.output_len[0] <= r.output_len <= s.output_len[1]
        # Outputs may hold any id but EOS; what the workload draws stays clear of the special ids too.
        assert all(0 <= t < s.vocab_size and t not in EOS for t in r.prompt_token_ids)
        assert min(r.prompt_token_ids[len(r.prompt_token_ids) - s.user_len[0]:]) >= FIRST_PROMPT_ID
    assert [r.arrival_s for r in requests] == steady_offsets(400, 0.05)


def test_tenants_have_their_own_system_prompts():
    s = spec(tenants=8)
    systems = system_prompts(s, seed=0)
    assert len({tuple(p[:BLOCK]) for p in systems}) == 8
    assert all(s.system_prompt_len[0] <= len(p) <= s.system_prompt_len[1] for p in systems)
    assert all(min(p) >= FIRST_PROMPT_ID for p in systems)
    assert system_prompts(spec(tenants=4), seed=0) == systems[:4]  # a tenant's prompt ignores the others
    requests = shared_prefix_requests(s, steady_offsets(300, 0.05), seed=0)
    assert len({r.tenant for r in requests}) == 8


def test_the_workload_is_seeded():
    offsets = steady_offsets(200, 0.05)
    for name in ("shared-prefix", "no-reuse"):
        assert build_requests(name, spec(), offsets, seed=4) == build_requests(name, spec(), offsets, seed=4)
        assert build_requests(name, spec(), offsets, seed=4) != build_requests(name, spec(), offsets, seed=5)


def test_no_reuse_keeps_the_lengths_and_shares_no_prefix():
    offsets = steady_offsets(300, 0.05)
    shared = build_requests("shared-prefix", spec(), offsets, seed=0)
    fresh = build_requests("no-reuse", spec(), offsets, seed=0)
    assert [(r.arrival_s, r.tenant, len(r.prompt_token_ids), r.output_len) for r in fresh] == \
        [(r.arrival_s, r.tenant, len(r.prompt_token_ids), r.output_len) for r in shared]
    assert len({tuple(r.prompt_token_ids[:BLOCK]) for r in fresh}) == len(fresh)
    assert all(r.after is None for r in fresh)


def test_a_conversation_ends_before_it_outgrows_the_context():
    s = spec(max_model_len=400, system_prompt_len=(100, 150), user_len=(40, 60), max_turns=50)
    requests = shared_prefix_requests(s, steady_offsets(300, 0.05), seed=0)
    assert all(len(r.prompt_token_ids) + r.output_len <= 400 for r in requests)
    assert max(r.turn for r in requests) >= 2


# -- capacity, SLOs, figures ------------------------------------------------------------
def test_capacity_follows_the_profile():
    profile = StepTimeProfile(base_s=0.08, per_prefill_token_s=0.001, per_decode_seq_s=0.002, per_context_token_s=0.0)
    # 100 prefill tokens, then 9 decode steps; the base of the 10 steps shared by DECODE_BATCH requests.
    assert request_pod_seconds(profile, 100, 10) == pytest.approx(0.1 + 9 * 0.002 + 0.08 * 10 / DECODE_BATCH)
    capacity = estimate_capacity(profile, [(100, 10), (300, 10)])
    assert capacity.fleet_rps(16) == pytest.approx(16 / capacity.pod_seconds_per_request)
    assert capacity.mean_prompt_tokens == 200


def test_a_disaggregated_fleet_serves_at_its_slower_pools_rate():
    profile = StepTimeProfile(base_s=0.08, per_prefill_token_s=0.001, per_decode_seq_s=0.002, per_context_token_s=0.0)
    # The prefill pod: 100 tokens and the first step's share of the base; the decode pod: the 9 steps after.
    prefill, decode = request_pod_seconds_by_pool(profile, 100, 10)
    assert (prefill, decode) == pytest.approx((0.1 + 0.08 / DECODE_BATCH, 9 * (0.002 + 0.08 / DECODE_BATCH)))
    assert prefill + decode == pytest.approx(request_pod_seconds(profile, 100, 10))
    capacity = estimate_capacity(profile, [(100, 10), (300, 10)])
    assert capacity.prefill_pod_seconds_per_request == pytest.approx(0.2 + 0.01)
    # 4 prefill pods serve 4 / 0.21 = 19 req/s, 1 decode pod 1 / 0.108 = 9.3: the decode pool bounds the fleet.
    assert capacity.disaggregated_fleet_rps(4, 1) == pytest.approx(1 / 0.108)
    assert capacity.disaggregated_fleet_rps(1, 4) == pytest.approx(1 / 0.21)


def test_slo_flag_uses_serve_names():
    assert parse_slo_flag("ttft=2000,itl=150") == {"ttft": 2000.0, "tpot": 150.0}
    with pytest.raises(ValueError, match="NAME=MS"):
        parse_slo_flag("latency=5")


def test_histogram_quantile_interpolates_within_a_bucket():
    buckets = {"0.1": 50.0, "0.2": 90.0, "0.4": 100.0, "+Inf": 100.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1)
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.15)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.38)
    assert histogram_quantile({"+Inf": 0.0}, 0.5) is None


def test_pods_split_evenly_over_processes():
    assert process_sizes(40, 16) == [14, 13, 13]
    assert process_sizes(256, 16) == [16] * 16 and process_sizes(4, 16) == [4]


def test_run_record_from_measurements():
    outcomes = [RequestOutcome(ttft_s=0.1 * (i + 1), e2el_s=1.0, itl_s=[0.05] * 3, prompt_tokens=100,
                               output_tokens=4) for i in range(4)] + [RequestOutcome(error="HTTP 503")]
    result = ReplayResult(outcomes, [0.0, 0.0, 0.0, 2.0, 0.0], duration_s=10.0)
    delta = {"prompt_tokens": 400.0, "cached_tokens": 300.0, "prefix_queries/ok": 18.0, "prefix_queries/timeout": 2.0,
             "gateway_cpu_s": 0.5, "gateway_ttft_sum": 1.2, "gateway_ttft_count": 4.0, "pod_ttft_sum": 1.0,
             "pod_ttft_count": 4.0, "pod_hit_tokens": 290.0, "pod_query_tokens": 400.0}
    run = run_record(RunSpec(8, 1, "shared-prefix", "score"), result, delta, 0.01, {"ttft": 250.0})
    assert (run["requests"], run["ok"], run["failed"]) == (5, 4, 1)
    assert run["hit_rate"] == 0.75 and run["pod_counter_hit_rate"] == 0.725
    assert run["prefix_queries_per_request"] == 4.0 and run["prefix_queries_by_outcome"]["timeout"] == 2.0
    assert run["gateway_cpu_ms_per_request"] == pytest.approx(100.0)
    assert run["gateway_added_ttft_mean_ms"] == pytest.approx(50.0)
    assert run["gateway_added_latency_p99_ms"] is None  # the gateway exposes no such histogram yet
    assert run["goodput_rps"] == pytest.approx(0.2)  # TTFT 100 and 200 ms meet 250 ms: 2 requests in 10 s
    assert run["ttft_p50_ms"] == pytest.approx(250.0) and run["late_sends"] == 1


# -- processes --------------------------------------------------------------------------
@pytest.fixture
def fast_profile(tmp_path):
    path = tmp_path / "fast-profile.json"
    path.write_text(json.dumps(FAST_PROFILE))
    return path


def _complete(base_url: str, key: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())["usage"]


def _next_turn_past_a_block_boundary(requests):
    """A later turn and its previous one, where the previous turn's output
    reaches into a block its prompt did not fill: only a prompt that really
    carries that output can hit the block."""
    for r in requests:
        if r.after is not None:
            prev = requests[r.after]
            length = len(prev.prompt_token_ids)
            if (length + prev.output_len - 1) // BLOCK > length // BLOCK:
                return prev, r
    raise AssertionError("no such turn in the workload")


@pytest.mark.slow
def test_the_next_turn_finds_the_previous_turn_and_its_output_cached(tiny_llama, fast_profile, tmp_path):
    """Through a real gateway to one simulated pod: a turn's prompt hits the
    whole previous turn, output included; another tenant's identical prompt
    hits nothing (its salt differs)."""
    keys = tenant_keys(2)
    settings = FleetSettings(tiny_llama, fast_profile, 16, 256, BLOCK, 2048,
                             write_tenants_file(tmp_path / "tenants.yaml", keys))
    prev, turn = _next_turn_past_a_block_boundary(shared_prefix_requests(spec(tenants=2), steady_offsets(50, 0.5), 0))
    with running_fleet(settings, 1, 1, {"policy": "round_robin"}, tmp_path / "run") as fleet:
        base, key = fleet.gateways[0].base_url, keys[turn.tenant]
        assert _complete(base, key, prev.prompt_token_ids, prev.output_len)["prompt_tokens_details"] \
            == {"cached_tokens": 0}
        usage = _complete(base, key, turn.prompt_token_ids, turn.output_len)
        # Cached: the full blocks of the previous prompt and all its output but the last token (never computed).
        seen = len(prev.prompt_token_ids) + prev.output_len - 1
        assert usage["prompt_tokens_details"]["cached_tokens"] == seen // BLOCK * BLOCK
        other = keys[1 - turn.tenant]
        assert _complete(base, other, prev.prompt_token_ids, 2)["prompt_tokens_details"]["cached_tokens"] == 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fleet_bench.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["fleet", *argv])


RUN_KEYS = {"pods", "gateways", "workload", "policy", "requests", "ok", "failed", "hit_rate", "pod_counter_hit_rate",
            "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "goodput_rps", "gateway_cpu_s",
            "gateway_cpu_ms_per_request", "prefix_queries_per_request", "prefix_queries_by_outcome",
            "gateway_added_latency_p50_ms", "gateway_added_latency_p99_ms", "gateway_added_ttft_mean_ms", "router",
            "latency", "wall_s"}


@pytest.mark.slow
def test_tiny_fleet_end_to_end(tiny_llama, fast_profile, tmp_path, capsys):
    out, plots = tmp_path / "fleet.json", tmp_path / "plots"
    # 8 tenants' system prompts (~1,200 tokens) overflow a 48-block pool
    # (768 tokens): round robin spreads every tenant over every pod and
    # keeps evicting; the scorer keeps tenants and conversations in place.
    args = _parse(["--model", str(tiny_llama), "--profile", str(fast_profile), "--pods", "4", "--gateways", "1",
                   "--policies", "round_robin,score", "--workloads", "shared-prefix", "--duration", "5",
                   "--rate", "5", "--kv-blocks", "48", "--tenants-per-pod", "2", "--system-prompt-len", "100,200",
                   "--user-len", "10,30", "--output-len", "4,8", "--think-time", "0.5", "--slo", "ttft=5000,itl=1000",
                   "--no-progress", "--output", str(out), "--plots", str(plots), "--logs", str(tmp_path / "logs")])
    assert args.bench_func(args) == 0
    report = json.loads(out.read_text())
    assert {"settings", "policies", "sources", "traces", "runs", "profile_coefficients"} <= set(report)
    trace = report["traces"]["4"]
    assert trace["tenants"] == 8 and trace["requests"] > 20
    runs = {r["policy"]: r for r in report["runs"]}
    assert set(runs) == {"round_robin", "score"}
    for run in runs.values():
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert (run["requests"], run["ok"], run["failed"]) == (trace["requests"], trace["requests"], 0), run["errors"]
        assert 0 <= run["hit_rate"] <= 1 and run["gateway_cpu_s"] > 0
        assert run["goodput_rps"] == pytest.approx(run["throughput_rps"])  # generous SLOs: all meet them
        assert math.isfinite(run["ttft_p99_ms"]) and run["ttft_p99_ms"] >= run["ttft_p50_ms"] > 0
    assert runs["round_robin"]["prefix_queries_per_request"] == 0
    assert runs["score"]["prefix_queries_per_request"] == 4  # every pod, every request
    assert runs["score"]["hit_rate"] > runs["round_robin"]["hit_rate"] + 0.1
    for name in ("hit_rate_vs_pods.png", "ttft_p99_vs_pods.png", "rpcs_per_request_vs_pods.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 4 | 1 | shared-prefix | score |" in capsys.readouterr().out
