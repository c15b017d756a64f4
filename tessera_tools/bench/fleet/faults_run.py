"""`tessera bench fleet --scenario faults`: a static fleet of --pods (the
first size given) in processes of --pods-per-process behind --gateways
(the first count given); at the start of the trace's spike, SIGKILL
ceil(10%) of the processes at once, as a node failure takes its pods.

Reported: how every request ended (scenario_replay.py: ok, failed before
or after streaming, lost), and per gateway how long it took to stop
routing to the killed pods (node_failure.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import random
import sys

from tqdm import tqdm

from tessera_tools.bench.common import work_dir, write_report
from tessera_tools.bench.fleet.fleet import MODEL_NAME, process_sizes, running_fleet
from tessera_tools.bench.fleet.node_failure import NodeFailure
from tessera_tools.bench.fleet.scenario_figures import endings, latency_figures
from tessera_tools.bench.fleet.scenario_replay import replay_traced
from tessera_tools.bench.fleet.scenario_setup import common_record, describe, fleet_settings, plan_scenario
from tessera_tools.bench.fleet.trace import SPIKE_START

KILLED_SHARE = 0.1


def killed_processes(processes: int, seed: int) -> list[int]:
    """Which processes die: ceil(10%) of them, drawn by the seed."""
    count = math.ceil(KILLED_SHARE * processes)
    if count >= processes:
        raise ValueError(f"{processes} pod process(es): killing {count} leaves none to serve; give more --pods or "
                         "fewer --pods-per-process")
    return sorted(random.Random(f"fleet-faults-{seed}").sample(range(processes), count))


def _summary(report: dict) -> list[str]:
    e, f = report["endings"], report["failure"]
    stopped = f["routing_stopped_after_s"]
    last = f["last_routing_decision_after_s"]
    return [
        f"killed {len(report['killed_processes'])} of {report['processes']} processes ({len(f['killed_pods'])} pods) "
        f"at t={f['kill_at_s']:.2f} s",
        f"requests: {e['ok']['count']} ok, {e['failed_after_streaming']['count']} failed after streaming, "
        f"{e['failed_before_streaming']['count']} failed before streaming, {e['lost']['count']} lost",
        "gateways stopped routing to the killed pods "
        + (f"within {stopped * 1e3:.0f} ms" if stopped is not None else "NOT within the run")
        + ("; no routing decision to them after the kill" if last is None
           else f"; last routing decision to them {last * 1e3:.0f} ms after the kill"),
    ]


def main(args: argparse.Namespace) -> int:
    pods, gateways = args.pods[0], args.gateways[0]
    try:
        processes = len(process_sizes(pods, args.pods_per_process))
        victims = killed_processes(processes, args.seed)
        scenario = plan_scenario(args, pods)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(scenario))
    bar = tqdm(total=len(scenario.requests), unit="req", disable=args.no_progress, leave=False, desc="faults")
    try:
        with work_dir(args.logs, "tessera-bench-fleet-faults-") as work:
            settings, keys = fleet_settings(args, scenario, args.pods_per_process, work)
            with running_fleet(settings, pods, gateways, scenario.router, work / "faults") as fleet:
                failure = NodeFailure([fleet.pods[i] for i in victims], [g.metrics_url for g in fleet.gateways],
                                      SPIKE_START * args.duration)
                try:
                    traced = asyncio.run(replay_traced(scenario.requests, [g.base_url for g in fleet.gateways], keys,
                                                       MODEL_NAME, args.request_timeout, bar, on_start=failure.arm))
                finally:
                    failure.stop()
    finally:
        bar.close()
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "scenario": "faults", **common_record(args, scenario),
              "settings": {"pods": pods, "pods_per_process": args.pods_per_process, "gateways": gateways,
                           "duration_s": args.duration, "load": args.load, "rate": args.rate,
                           "spike_factor": args.spike_factor, "seed": args.seed, "kv_blocks": args.kv_blocks,
                           "block_size": args.block_size, "killed_share": KILLED_SHARE},
              "processes": processes, "killed_processes": victims,
              **latency_figures(traced, scenario.slos), "endings": endings(traced), "failure": failure.record()}
    write_report(report, args.output)
    for line in _summary(report):
        print(line)
    return 0
