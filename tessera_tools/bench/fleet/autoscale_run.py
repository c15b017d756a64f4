"""`tessera bench fleet --scenario autoscale`: one trace, two fleets, in an
order that alternates with --seed:

- autoscaled: starts at --min-replicas pods (0: scale from zero; the
  gateways then queue requests while no pod is listed) and is scaled by
  the operator's own decide() every --scale-interval (autoscaler.py);
- static: --max-replicas pods, sized for the spike, through the whole trace.

Both run one simulated pod per process behind gateways reading the pods
file, so they differ only in who sets the pod count.
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

from tessera_operator.autoscale import TARGET_FIELDS, ScalingPolicy
from tessera_operator.crd_engine import autoscaling_schema
from tessera_tools.bench.common import rotated, work_dir, write_report
from tessera_tools.bench.fleet.autoscale_report import (
    DISAGGREGATED_NOTE, comparison, fleet_record, scale_from_zero, summary_lines,
)
from tessera_tools.bench.fleet.autoscaler import Autoscaler, ControlLoop
from tessera_tools.bench.fleet.elastic_fleet import (
    FILE_POLL_S, QUEUE_TIMEOUT_MARGIN_S, REMOVAL_GRACE_POLLS, fetch_text, file_gateway_config, pod_launcher,
    running_gateways,
)
from tessera_tools.bench.fleet.elastic_pool import ElasticPool, PoolTimings
from tessera_tools.bench.fleet.fleet import MODEL_NAME, FleetSettings
from tessera_tools.bench.fleet.pods_file import PodsFile
from tessera_tools.bench.fleet.scenario_figures import offered_rate
from tessera_tools.bench.fleet.scenario_replay import replay_traced
from tessera_tools.bench.fleet.scenario_setup import Scenario, common_record, describe, fleet_settings, plan_scenario

FLEETS = ("autoscaled", "static")
# The offered rate of the report and the plot: about this many bins over the trace (none shorter than a tick).
RATE_BINS = 30


def scaling_policy(args: argparse.Namespace) -> ScalingPolicy:
    """The flags over the CRD's defaults (target of the signal, tolerance, scale-up step; scale-down step
    unless --max-scale-down-step)."""
    if args.min_replicas > args.max_replicas:
        raise ValueError(f"--min-replicas {args.min_replicas} exceeds --max-replicas {args.max_replicas}")
    crd = autoscaling_schema()["properties"]["mixed"]["properties"]
    target = args.scale_target if args.scale_target is not None else crd[TARGET_FIELDS[args.scale_signal]]["default"]
    return ScalingPolicy(signal=args.scale_signal, target=float(target), min_replicas=args.min_replicas,
                         max_replicas=args.max_replicas, tolerance=crd["tolerance"]["default"],
                         up_window_s=args.scale_up_window, down_window_s=args.scale_down_window,
                         max_up_step=crd["maxScaleUpStep"]["default"],
                         max_down_step=args.max_scale_down_step or crd["maxScaleDownStep"]["default"])


@dataclass(frozen=True)
class FleetRun:
    kind: str
    """"autoscaled" or "static"."""
    initial_pods: int
    """Ready before the trace starts."""
    policy: ScalingPolicy | None
    """None: the pod count never changes."""
    interval_s: float
    startup_delay_s: float
    queue_without_pods: bool


def fleet_runs(args: argparse.Namespace, policy: ScalingPolicy) -> dict[str, FleetRun]:
    return {"autoscaled": FleetRun("autoscaled", policy.min_replicas, policy, args.scale_interval,
                                   args.startup_delay, policy.min_replicas == 0),
            "static": FleetRun("static", policy.max_replicas, None, args.scale_interval, 0.0, False)}


def _bring_up(pool: ElasticPool, pods: int, gateways, startup_delay_s: float) -> None:
    """`pods` ready and routed before the trace (a pod that dies starting is replaced)."""
    deadline = time.monotonic() + 60 + startup_delay_s + pods
    while len(pool.in_state("ready")) < pods:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pods} pods not ready after {60 + startup_delay_s + pods:.0f} s")
        now = time.monotonic()
        pool.scale_to(pods, now)
        pool.step(now)
        time.sleep(0.1)
    for gw in gateways:
        gw.wait_ready(num_pods=pods, timeout=60 + pods / 2)


def run_fleet(run: FleetRun, scenario: Scenario, settings: FleetSettings, keys: list[str], gateways: int,
              run_dir: Path, request_timeout_s: float, bar: tqdm) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    pods_file = PodsFile(run_dir / "pods.yaml")
    pool = ElasticPool(pod_launcher(settings, run_dir), pods_file,
                       PoolTimings(run.startup_delay_s, REMOVAL_GRACE_POLLS * FILE_POLL_S))
    config = file_gateway_config(settings, pods_file.path, scenario.router, run.queue_without_pods,
                                 run.startup_delay_s + run.interval_s + QUEUE_TIMEOUT_MARGIN_S)
    autoscaler = loop = None
    try:
        with running_gateways(config, gateways, run_dir) as gws:
            _bring_up(pool, run.initial_pods, gws, run.startup_delay_s)
            if run.policy is not None:
                autoscaler = Autoscaler(run.policy, pool, fetch_text, [g.metrics_url for g in gws])
            loop = ControlLoop(pool, autoscaler, run.interval_s)
            traced = asyncio.run(replay_traced(scenario.requests, [g.base_url for g in gws], keys, MODEL_NAME,
                                               request_timeout_s, bar, on_start=lambda t0: loop.start()))
            loop.stop()
            rss = [p.handle.rss_bytes() for p in pool.pods if p.exited_at is None]
    finally:
        if loop is not None:
            loop.stop()
        pool.close()
    record = fleet_record(run.kind, traced, pool, autoscaler, scenario.slos)
    rss = [r for r in rss if r]
    record["pod_process_rss_mb"] = statistics.median(rss) / 2**20 if rss else None
    if run.policy is not None and run.initial_pods == 0:
        record["scale_from_zero"] = scale_from_zero(traced, record, run.startup_delay_s)
    return record


def _settings_record(args: argparse.Namespace, policy: ScalingPolicy) -> dict:
    return {"min_replicas": policy.min_replicas, "max_replicas": policy.max_replicas,
            "scale_signal": policy.signal, "scale_target": policy.target, "tolerance": policy.tolerance,
            "up_window_s": policy.up_window_s, "down_window_s": policy.down_window_s,
            "max_up_step": policy.max_up_step, "max_down_step": policy.max_down_step,
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
        policy = scaling_policy(args)
        scenario = plan_scenario(args, policy.max_replicas)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(scenario))
    order = rotated(FLEETS, args.seed)
    runs = _run_all(args, scenario, fleet_runs(args, policy), order)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "scenario": "autoscale", **common_record(args, scenario), "settings": _settings_record(args, policy),
              "order": order, "runs": runs, "limits": [DISAGGREGATED_NOTE],
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
    print(f"note: {DISAGGREGATED_NOTE}")
    if args.plots and not failed:
        from tessera_tools.bench.fleet.scenario_plots import write_timeline_plot  # matplotlib: only when asked

        print(f"wrote {write_timeline_plot(report, args.plots)}")
    return 1 if failed else 0
