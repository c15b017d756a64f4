"""`tessera bench fleet --scenario autoscale --disaggregated`: a prefill and
a decode pool, each with the operator's policy for its role (the CRD's
per-pool signals and defaults), listed in one pods file and scaled on one
scrape of the gateways per tick; the comparison over both pools'
pod-minutes; and a small fleet end to end, P/D through a real redis-server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tessera_tools.bench.fleet.autoscale_report import comparison
from tessera_tools.bench.fleet.autoscale_run import fleet_runs
from tessera_tools.bench.fleet.autoscaler import Autoscaler, ControlLoop
from tessera_tools.bench.fleet.elastic_pool import ElasticPool, PoolTimings
from tessera_tools.bench.fleet.pd_store import kv_store_counters, pod_args, routing_by_kind
from tessera_tools.bench.fleet.pods_file import PodsFile
from tessera_tools.bench.fleet.scaling_policies import pool_policies
from tests.tessera_tools.bench.test_bench_fleet_scenarios import (  # noqa: F401 (fast_profile: a fixture)
    DELAY, GATEWAYS, GRACE, FakePod, _parse, _run_report, _small, fast_profile, gateway_text, pod_text,
)

PD = ["--scenario", "autoscale", "--disaggregated"]


# -- the pools' policies from the flags ------------------------------------------------
def test_each_pool_defaults_to_the_crds_signal_and_target_for_its_role():
    policies = pool_policies(_parse(PD))
    assert list(policies) == ["prefill", "decode"]
    prefill, decode = policies["prefill"], policies["decode"]
    assert (prefill.signal, prefill.target, decode.signal, decode.target) == ("concurrency", 8.0, "kvUsage", 0.8)
    assert (prefill.min_replicas, prefill.max_replicas, decode.min_replicas, decode.max_replicas) == (1, 4, 1, 4)
    both = pool_policies(_parse([*PD, "--prefill-scale-signal", "concurrency", "--decode-scale-signal", "concurrency",
                                 "--decode-scale-target", "3", "--decode-max-replicas", "6", "--scale-down-window",
                                 "12"]))
    assert (both["prefill"].signal, both["prefill"].target) == ("concurrency", 8.0)
    assert (both["decode"].target, both["decode"].max_replicas, both["decode"].down_window_s) == (3.0, 6, 12.0)


@pytest.mark.parametrize("role, signal, allowed", [("decode", "queue", "itl, kvUsage, concurrency"),
                                                   ("decode", "ttft", "itl, kvUsage, concurrency"),
                                                   ("prefill", "itl", "queue, ttft, concurrency"),
                                                   ("prefill", "kvUsage", "queue, ttft, concurrency")])
def test_a_pool_on_a_signal_the_crd_does_not_allow_its_role_is_refused(role, signal, allowed):
    with pytest.raises(ValueError) as e:
        pool_policies(_parse([*PD, f"--{role}-scale-signal", signal]))
    assert str(e.value) == (f"--{role}-scale-signal {signal}: a {role} pool scales on {allowed} "
                            f"(the CRD's autoscaling.{role}.signal)")


@pytest.mark.parametrize("argv, named", [
    ([*PD, "--scale-signal", "concurrency"], "--scale-signal: not used with --disaggregated"),
    ([*PD, "--max-replicas", "16"], "--max-replicas: not used with --disaggregated"),
    (["--scenario", "autoscale", "--decode-max-replicas", "3"], "--decode-max-replicas: not used with a mixed pool"),
    ([*PD, "--prefill-min-replicas", "3", "--prefill-max-replicas", "2"],
     "--prefill-min-replicas 3 exceeds --prefill-max-replicas 2"),
])
def test_a_flag_of_the_other_mode_or_crossed_bounds_are_refused(argv, named):
    with pytest.raises(ValueError, match=named):
        pool_policies(_parse(argv))


def test_the_command_exits_2_naming_the_flag_before_starting_anything(capsys, tmp_path, monkeypatch):
    from tessera_tools.bench.fleet import autoscale_run

    def no_fleet(*_):
        raise AssertionError("a fleet was started")

    monkeypatch.setattr(autoscale_run, "_run_all", no_fleet)  # never a whole run, even when the check is broken
    args = _parse([*PD, "--decode-scale-signal", "queue", "--output", str(tmp_path / "r.json")])
    assert args.bench_func(args) == 2
    assert "error: --decode-scale-signal queue: a decode pool scales on itl" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_mixed_run_keeps_its_one_pool():
    args = _parse(["--scenario", "autoscale", "--scale-signal", "ttft", "--max-replicas", "5"])
    (policy,) = pool_policies(args).values()
    assert (list(pool_policies(args)), policy.signal, policy.target, policy.max_replicas) == (["mixed"], "ttft", 1.0, 5)


def test_the_static_fleet_runs_each_pool_at_its_maximum_and_the_autoscaled_starts_at_its_minimum():
    args = _parse([*PD, "--prefill-min-replicas", "0", "--prefill-max-replicas", "3", "--decode-max-replicas", "5"])
    runs = fleet_runs(args, pool_policies(args))
    auto, static = runs["autoscaled"], runs["static"]
    assert [(p.role, p.initial_pods) for p in auto.pools] == [("prefill", 0), ("decode", 1)]
    assert [(p.role, p.initial_pods, p.policy) for p in static.pools] == [("prefill", 3, None), ("decode", 5, None)]
    assert auto.disaggregated and auto.queue_without_pods and not static.queue_without_pods  # a pool may be at 0


# -- the pools in the loop ---------------------------------------------------------------
class TwoPools:
    """A prefill and a decode pool of fake pods in one pods file, each with its autoscaler."""

    def __init__(self, tmp_path, args) -> None:
        self.pages = {url: gateway_text(0) for url in GATEWAYS}
        self.fetched: list[str] = []
        self.pods_file = PodsFile(tmp_path / "pods.yaml", ("prefill", "decode"))
        self.pools = {role: ElasticPool(lambda name, role=role: FakePod(f"{role}-{name}", self.pods_file),
                                        self.pods_file, PoolTimings(DELAY, GRACE), role)
                      for role in ("prefill", "decode")}
        self.autoscalers = {role: Autoscaler(policy, self.pools[role], self._fetch, GATEWAYS, clock=lambda: 0.0)
                            for role, policy in pool_policies(args).items()}

    def _fetch(self, url: str) -> str:
        self.fetched.append(url)
        return self.pages[url]

    def bring_up(self, role: str, count: int) -> list[FakePod]:
        pool = self.pools[role]
        pool.scale_to(count, -DELAY)
        for pod in pool.pods:
            pod.handle.is_serving = True
        pool.step(0.0)
        self.autoscalers[role].replicas = count
        return [p.handle for p in pool.pods]

    def listed(self) -> dict:
        return yaml.safe_load(self.pods_file.path.read_text())


def test_each_pool_lists_its_pods_under_its_role_in_the_one_pods_file(tmp_path):
    h = TwoPools(tmp_path, _parse(PD))
    assert h.listed() == {"prefill": [], "decode": []}
    (p,) = h.bring_up("prefill", 1)
    d1, d2 = h.bring_up("decode", 2)
    assert h.listed() == {"prefill": [p.address], "decode": sorted([d1.address, d2.address])}
    h.pools["decode"].scale_to(1, 1.0)
    assert h.listed() == {"prefill": [p.address], "decode": [d1.address]}


def test_one_gateway_scrape_per_tick_feeds_every_pool_which_decides_on_its_own_signal(tmp_path):
    """The prefill pool on its waiting queue, the decode pool on concurrency: one tick scrapes each gateway
    once and both pools see its queued count; each scales on its own signal against its own target."""
    h = TwoPools(tmp_path, _parse([*PD, "--prefill-scale-signal", "queue", "--decode-scale-signal", "concurrency",
                                   "--decode-scale-target", "4"]))
    (p,) = h.bring_up("prefill", 1)
    (d,) = h.bring_up("decode", 1)
    h.pages[p.metrics_url] = pod_text(waiting=1, running=2)  # queue 1 vs target 4: down, but not yet (window)
    h.pages[d.metrics_url] = pod_text(running=10)  # concurrency (10 + 2 queued) vs 4: up to 3
    h.pages[GATEWAYS[0]] = gateway_text(2)
    loop = ControlLoop(list(h.pools.values()), list(h.autoscalers.values()), interval_s=1.0)
    loop._tick(0.0)
    assert sorted(u for u in h.fetched if u in GATEWAYS) == sorted(GATEWAYS)  # once each, for both pools
    prefill, decode = h.autoscalers["prefill"].ticks[-1], h.autoscalers["decode"].ticks[-1]
    assert prefill["gateway_queued"] == decode["gateway_queued"] == 2
    assert (prefill["reason"], prefill["asked"], prefill["signal"]) == ("Steady", 1, 1.0)  # ceil(0.25) = 1
    assert (decode["reason"], decode["asked"], decode["signal"]) == ("ScaleUp", 3, 12.0)
    assert "concurrency 12 vs target 4" in decode["message"]
    assert len(h.pools["decode"].active) == 3 and len(h.pools["prefill"].active) == 1


def test_the_acceptance_counts_both_pools_pod_minutes_together():
    def run(attainment, prefill, decode):
        return {"slo_attainment": attainment, "pod_minutes": prefill + decode,
                "pools": {"prefill": {"pod_minutes": prefill}, "decode": {"pod_minutes": decode}}}

    c = comparison(run(0.97, 2.0, 4.0), run(1.0, 4.0, 4.0))  # decode alone would be 1.0: not met
    assert c["pod_minutes_ratio"] == 0.75 and c["acceptance"]["met"]
    assert c["pools"] == {"prefill": {"autoscaled_pod_minutes": 2.0, "static_pod_minutes": 4.0,
                                      "pod_minutes_ratio": 0.5},
                          "decode": {"autoscaled_pod_minutes": 4.0, "static_pod_minutes": 4.0,
                                     "pod_minutes_ratio": 1.0}}
    assert not comparison(run(0.97, 2.0, 4.1), run(1.0, 4.0, 4.0))["acceptance"]["met"]


# -- what went through the store ---------------------------------------------------------
def test_the_pools_kv_store_counters_and_the_gateways_calls_by_kind():
    pod = ('tessera_kv_store_hits_total{model_name="m",tier="redis"} 6.0\n'
           'tessera_kv_store_hits_total{model_name="m",tier="host"} 50.0\n'
           'tessera_kv_store_read_bytes_total{model_name="m",tier="redis"} 600.0\n'
           'tessera_kv_store_rejected_values_total{model_name="m",tier="redis",reason="mac"} 1.0\n')
    counters = kv_store_counters([pod, pod.replace("6.0", "4.0")])
    assert counters == {"redis_hits": 10.0, "redis_read_bytes": 1200.0, "redis_written_bytes": 0.0,
                        "rejected_values": 2.0}
    gateway = ('tessera_gateway_routing_decisions_total{kind="prefill",pod="a:1",role="prefill"} 3.0\n'
               'tessera_gateway_routing_decisions_total{kind="decode",pod="b:1",role="decode"} 3.0\n'
               'tessera_gateway_routing_decisions_total{kind="route",pod="b:1",role="decode"} 2.0\n')
    assert routing_by_kind([gateway, gateway]) == {"prefill": 6.0, "decode": 6.0, "route": 4.0}


def test_a_pd_pod_gets_its_role_and_the_store_a_mixed_pod_nothing():
    assert pod_args("decode", "redis://127.0.0.1:1/0") == ["--role", "decode", "--kv-redis-url", "redis://127.0.0.1:1/0"]
    assert pod_args("mixed", None) == []
    with pytest.raises(ValueError, match="needs the shared KV store"):
        pod_args("prefill", None)


# -- end to end ---------------------------------------------------------------------------
def _still_running_under(folder: Path) -> list[str]:
    """Command lines of processes that mention `folder` (pods' logs, the gateways' and redis's work dirs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(folder) in cmdline and pid != str(os.getpid()):
            found.append(cmdline)
    return found


@pytest.mark.slow
def test_disaggregated_autoscale_end_to_end(tiny_llama, fast_profile, tmp_path):
    """One prefill and one decode pod, each pool scaled up to 2 on its own signal (prefill on TTFT, decode on
    concurrency, targets low enough that any traffic scales them); prompts long enough to go through P/D."""
    args = _small(tiny_llama, fast_profile, tmp_path, *PD, "--system-prompt-len", "300,400", "--rate", "4",
                  "--output-len", "4,8", "--prefill-max-replicas", "2", "--decode-max-replicas", "2",
                  "--prefill-scale-signal", "ttft", "--prefill-scale-target", "0.001",
                  "--decode-scale-signal", "concurrency", "--decode-scale-target", "0.02",
                  "--startup-delay", "1", "--scale-interval", "1", "--scale-down-window", "3",
                  "--plots", str(tmp_path / "plots"))
    report = _run_report(args)
    auto, static = report["runs"]["autoscaled"], report["runs"]["static"]
    for run in (auto, static):
        assert run["requests"] == report["trace"]["requests"] and run["failed"] == 0, run["endings"]
        assert set(run["pools"]) == {"prefill", "decode"} and "timeline" not in run
        assert run["pod_minutes"] == pytest.approx(sum(p["pod_minutes"] for p in run["pools"].values()))
        calls, kv = run["pd"]["gateway_calls"], run["pd"]["kv_store"]
        assert calls["prefill"] > 0 and calls["decode"] > 0  # requests went through P/D
        assert kv["decode"]["pods_scraped"] >= 1 and kv["decode"]["rejected_values"] == 0
        assert run["pd"]["redis"]["keys"] > 0 and run["pd"]["redis"]["keyspace_hits"] > 0
    assert static["pd"]["kv_store"]["decode"]["redis_hits"] > 0  # its decode pods loaded the prefill pods' KV
    for role, (signal, target) in {"prefill": ("ttft", 0.001), "decode": ("concurrency", 0.02)}.items():
        pool = auto["pools"][role]
        assert pool["timeline"] and max(t["asked"] for t in pool["timeline"]) == 2
        up = [d for d in pool["decisions"] if d["reason"] == "ScaleUp"]
        assert up and f"{signal} " in up[0]["message"] and f"vs target {target:.3g}" in up[0]["message"]
        assert report["settings"]["pools"][role]["scale_signal"] == signal
        assert static["pools"][role]["pods_started"] == 2 and not static["pools"][role]["decisions"]
    c = report["comparison"]
    assert c["static_pod_minutes"] == pytest.approx(4 * static["window_s"] / 60, rel=0.01)
    assert set(c["pools"]) == {"prefill", "decode"} and 0 < c["pod_minutes_ratio"] < 1
    assert any("not split by pool" in note for note in report["limits"])
    assert (tmp_path / "plots" / "autoscale_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _still_running_under(tmp_path) == []  # pods, gateways and the redis-server all stopped
