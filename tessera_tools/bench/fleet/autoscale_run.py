"""`tessera bench fleet --scenario autoscale`: one trace, two fleets, in an
order that alternates with --seed:

- autoscaled: starts at --min-replicas pods (0: scale from zero; the
  gateways then queue requests while no pod is listed) and is scaled by
  the operator's own decide() every --scale-interval (autoscaler.py);
- static: --max-replicas pods, sized for the spike, through the whole trace.

With --disaggregated each fleet is a prefill pool and a decode pool instead
(--prefill-*, --decode-*), sharing a redis-server started for the fleet's
run (pd_store.py) and listed in one pods file: the autoscaled fleet scales
each pool on its own policy and signal, as the operator does; the static
one runs each at its maximum.

Both run one simulated pod per process behind gateways reading the pods
file, so they differ only in who sets the pod counts.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tessera_operator.autoscale import ScalingPolicy
from tessera_tools.bench.common import rotated, work_dir, write_report
from tessera_tools.bench.fleet.autoscale_report import (
    comparison, fleet_record, limits, scale_from_zero, summary_lines,
)
from tessera_tools.bench.fleet.autoscaler import Autoscaler, ControlLoop
from tessera_tools.bench.fleet.elastic_fleet import (
    FILE_POLL_S, QUEUE_TIMEOUT_MARGIN_S, REMOVAL_GRACE_POLLS, fetch_text, file_gateway_config, pod_launcher,
    running_gateways,
)
from tessera_tools.bench.fleet.elastic_pool import ElasticPool, PoolTimings, close_pools
from tessera_tools.bench.fleet.fleet import MODEL_NAME, FleetSettings
from tessera_tools.bench.fleet.pd_store import kv_store_counters, pod_args, redis_figures, routing_by_kind, shared_store
from tessera_tools.bench.fleet.pods_file import PodsFile
from tessera_tools.bench.fleet.scaling_policies import pool_policies
from tessera_tools.bench.fleet.scenario_figures import offered_rate
from tessera_tools.bench.fleet.scenario_replay import replay_traced
from tessera_tools.bench.fleet.sweep import PDPools
from tessera_tools.bench.fleet.scenario_setup import Scenario, common_record, describe, fleet_settings, plan_scenario

FLEETS = ("autoscaled", "static")
# The offered rate of the report and the plot: about this many bins over the trace (none shorter than a tick).
RATE_BINS = 30


@dataclass(frozen=True)
class PoolRun:
    """One pool of a fleet's run."""

    role: str
    """mixed, prefill or decode: its pods' --role, and their key in the pods file."""
    initial_pods: int
    """Ready before the trace starts."""
    policy: ScalingPolicy | None
    """None: the pool's size never changes."""


@dataclass(frozen=True)
class FleetRun:
    kind: str
    """"autoscaled" or "static"."""
    pools: tuple[PoolRun, ...]
    """One mixed pool, or a prefill and a decode pool."""
    interval_s: float
    """Seconds between the autoscalers' ticks."""
    startup_delay_s: float
    """A pod started during the run is listed no earlier than this after its process started."""
    queue_without_pods: bool
    """The gateways hold requests while no pod serves them (a pool may be at zero, as the operator renders)."""

    @property
    def disaggregated(self) -> bool:
        return any(p.role != "mixed" for p in self.pools)


def fleet_runs(args: argparse.Namespace, policies: dict[str, ScalingPolicy]) -> dict[str, FleetRun]:
    """The autoscaled fleet starts each pool at its minimum; the static one runs each at its maximum."""
    scaled = tuple(PoolRun(role, p.min_replicas, p) for role, p in policies.items())
    static = tuple(PoolRun(role, p.max_replicas, None) for role, p in policies.items())
    from_zero = any(p.min_replicas == 0 for p in policies.values())
    return {"autoscaled": FleetRun("autoscaled", scaled, args.scale_interval, args.startup_delay, from_zero),
            "static": FleetRun("static", static, args.scale_interval, 0.0, False)}


def _bring_up(pools: list[tuple[ElasticPool, int]], gateways, startup_delay_s: float) -> None:
    """Each pool's pods ready and routed before the trace (a pod that dies starting is replaced)."""
    total = sum(pods for _, pods in pools)
    limit_s = 60 + startup_delay_s + total
    deadline = time.monotonic() + limit_s
    while any(len(pool.in_state("ready")) < pods for pool, pods in pools):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{total} pods not ready after {limit_s:.0f} s")
        now = time.monotonic()
        for pool, pods in pools:
            pool.scale_to(pods, now)
            pool.step(now)
        time.sleep(0.1)
    for gw in gateways:
        gw.wait_ready(num_pods=total, timeout=60 + total / 2)


def _pools(run: FleetRun, settings: FleetSettings, pods_file: PodsFile, run_dir: Path,
           redis_url: str | None) -> dict[str, ElasticPool]:
    """One ElasticPool per role; a P/D pool's pod logs go in a folder of the role (names repeat across pools)."""
    timings = PoolTimings(run.startup_delay_s, REMOVAL_GRACE_POLLS * FILE_POLL_S)
    pools = {}
    for p in run.pools:
        log_dir = run_dir if p.role == "mixed" else run_dir / p.role
        log_dir.mkdir(parents=True, exist_ok=True)
        pools[p.role] = ElasticPool(pod_launcher(settings, log_dir, pod_args(p.role, redis_url)), pods_file, timings,
                                    p.role)
    return pools


def _answered(urls: list[str]) -> list[str]:
    """The /metrics texts of the urls that answered (a figure of the report must not fail the run)."""
    texts = []
    for url in urls:
        try:
            texts.append(fetch_text(url))
        except OSError:
            pass
    return texts


def _pd_figures(pools: dict[str, ElasticPool], gateways, store) -> dict:
    """What went through the KV store, read at the trace's end: each pool's KV-store counters over the pods
    still running (a pod removed earlier took its counters with it), the gateways' engine calls by kind, and
    Redis's own stats."""
    kv = {}
    for role, pool in pools.items():
        texts = _answered([p.handle.metrics_url for p in pool.pods if p.exited_at is None])
        kv[role] = {**kv_store_counters(texts), "pods_scraped": len(texts), "pods_started": len(pool.pods)}
    return {"kv_store": kv, "gateway_calls": routing_by_kind(_answered([g.metrics_url for g in gateways])),
            "redis": redis_figures(store)}


def run_fleet(run: FleetRun, scenario: Scenario, settings: FleetSettings, keys: list[str], gateways: int,
              run_dir: Path, request_timeout_s: float, bar: tqdm) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    pods_file = PodsFile(run_dir / "pods.yaml", tuple(p.role for p in run.pools))
    config = file_gateway_config(settings, pods_file.path, scenario.router, run.queue_without_pods,
                                 run.startup_delay_s + run.interval_s + QUEUE_TIMEOUT_MARGIN_S)
    with shared_store(run_dir, run.disaggregated) as store:
        pools = _pools(run, settings, pods_file, run_dir, store and store.url)
        autoscalers: dict[str, Autoscaler] = {}
        loop = pd = None
        try:
            with running_gateways(config, gateways, run_dir) as gws:
                _bring_up([(pools[p.role], p.initial_pods) for p in run.pools], gws, run.startup_delay_s)
                urls = [g.metrics_url for g in gws]
                autoscalers = {p.role: Autoscaler(p.policy, pools[p.role], fetch_text, urls)
                               for p in run.pools if p.policy is not None}
                loop = ControlLoop(list(pools.values()), list(autoscalers.values()), run.interval_s)
                traced = asyncio.run(replay_traced(scenario.requests, [g.base_url for g in gws], keys, MODEL_NAME,
                                                   request_timeout_s, bar, on_start=lambda t0: loop.start()))
                loop.stop()
                rss = [p.handle.rss_bytes() for pool in pools.values() for p in pool.pods if p.exited_at is None]
                if store is not None:
                    pd = _pd_figures(pools, gws, store)
        finally:
            if loop is not None:
                loop.stop()
            close_pools(list(pools.values()))
    record = fleet_record(run.kind, traced, pools, autoscalers, scenario.slos)
    rss = [r for r in rss if r]
    record["pod_process_rss_mb"] = statistics.median(rss) / 2**20 if rss else None
    if pd is not None:
        record["pd"] = pd
    first = run.pools[0]
    if not run.disaggregated and first.policy is not None and first.initial_pods == 0:
        record["scale_from_zero"] = scale_from_zero(traced, record, run.startup_delay_s)
    return record


def _policy_record(policy: ScalingPolicy) -> dict:
    return {"min_replicas": policy.min_replicas, "max_replicas": policy.max_replicas,
            "scale_signal": policy.signal, "scale_target": policy.target, "tolerance": policy.tolerance,
            "up_window_s": policy.up_window_s, "down_window_s": policy.down_window_s,
            "max_up_step": policy.max_up_step, "max_down_step": policy.max_down_step,
            "down_stabilization": policy.down_stabilization}


def _settings_record(args: argparse.Namespace, policies: dict[str, ScalingPolicy]) -> dict:
    pools = ({"pools": {role: _policy_record(p) for role, p in policies.items()}} if args.disaggregated
             else _policy_record(policies["mixed"]))
    return {**pools, "disaggregated": args.disaggregated,
            "scale_interval_s": args.scale_interval, "startup_delay_s": args.startup_delay,
            "gateways": args.gateways[0], "pods_per_process": 1, "duration_s": args.duration, "load": args.load,
            "rate": args.rate, "spike_factor": args.spike_factor, "seed": args.seed, "kv_blocks": args.kv_blocks,
            "block_size": args.block_size, "file_poll_s": FILE_POLL_S,
            "removal_grace_s": REMOVAL_GRACE_POLLS * FILE_POLL_S}


def _run_all(args, scenario: Scenario, runs: dict[str, FleetRun], order: list[str]) -> dict[str, dict]:
    records = {}
    with work_dir(args.logs, "tessera-bench-fleet-autoscale-") as work:
        settings, keys = fleet_settings(args, scenario, 1, work)
        for i, kind in enumerate(order):
            bar = tqdm(total=len(scenario.requests), unit="req", disable=args.no_progress, leave=False,
                       desc=f"[{i + 1}/{len(order)}] {kind}")
            try:
                records[kind] = run_fleet(runs[kind], scenario, settings, keys, args.gateways[0], work / kind,
                                          args.request_timeout, bar)
            except Exception as e:  # the report still says what the other fleet did
                records[kind] = {"fleet": kind, "error": f"{type(e).__name__}: {e}"[:500]}
            finally:
                bar.close()
    return records


def main(args: argparse.Namespace) -> int:
    try:
        policies = pool_policies(args)
        pd = PDPools(policies["prefill"].max_replicas, policies["decode"].max_replicas) if args.disaggregated else None
        scenario = plan_scenario(args, sum(p.max_replicas for p in policies.values()), pd)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(scenario))
    order = rotated(FLEETS, args.seed)
    runs = _run_all(args, scenario, fleet_runs(args, policies), order)
    notes = limits(args.disaggregated)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "scenario": "autoscale", **common_record(args, scenario), "settings": _settings_record(args, policies),
              "order": order, "runs": runs, "limits": notes,
              "offered_rate": offered_rate(scenario.plan.offsets, args.duration,
                                           max(args.scale_interval, args.duration / RATE_BINS))}
    failed = [r["error"] for r in runs.values() if "error" in r]
    if not failed:
        report["comparison"] = comparison(runs["autoscaled"], runs["static"])
    if "scale_from_zero" in runs["autoscaled"]:
        report["scale_from_zero"] = runs["autoscaled"]["scale_from_zero"]
    write_report(report, args.output)
    for line in summary_lines(report) if not failed else [f"run failed: {e}" for e in failed]:
        print(line)
    for note in notes:
        print(f"note: {note}")
    if args.plots and not failed:
        from tessera_tools.bench.fleet.scenario_plots import write_timeline_plot  # matplotlib: only when asked

        print(f"wrote {write_timeline_plot(report, args.plots)}")
    return 1 if failed else 0
