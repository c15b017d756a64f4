"""One run of the sweep: fresh pods and gateways for one (fleet size,
gateway replicas, workload, policy), the trace replayed through them, the
counters and CPU read around it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tqdm import tqdm

from tessera_tools.bench.fleet.fleet import MODEL_NAME, Fleet, FleetSettings, running_fleet
from tessera_tools.bench.fleet.measure import cpu_seconds, difference, snapshot
from tessera_tools.bench.fleet.policies import POLICIES
from tessera_tools.bench.fleet.replay import replay
from tessera_tools.bench.fleet.report import RunSpec, run_record
from tessera_tools.bench.fleet.workload import FleetRequest

# Seconds the gateways' CPU is watched before the trace, with no request in
# flight: their cost of load reports alone, which grows with the fleet.
IDLE_WINDOW_S = 2.0
# After the last response: the gateways count a request's usage when its
# stream closes, a moment after the client saw [DONE].
SETTLE_S = 0.5


def _snapshot(fleet: Fleet) -> dict[str, float]:
    return snapshot([g.metrics_url for g in fleet.gateways if g.metrics_url], fleet.pod_metrics_urls,
                    [g.proc.pid for g in fleet.gateways], [p.proc.pid for p in fleet.pods])


def run_one(spec: RunSpec, requests: list[FleetRequest], settings: FleetSettings, api_keys: list[str],
            slos: dict[str, float], run_dir: Path, request_timeout_s: float, bar: tqdm) -> dict:
    started = time.monotonic()
    router = POLICIES[spec.policy].router
    with running_fleet(settings, spec.pods, spec.gateways, router, run_dir) as fleet:
        bar.set_postfix_str(f"up in {fleet.pods_start_s + fleet.gateways_start_s:.1f} s", refresh=True)
        idle_from = sum(cpu_seconds(g.proc.pid) for g in fleet.gateways)
        time.sleep(IDLE_WINDOW_S)
        before = _snapshot(fleet)
        idle_cpu_per_s = (before["gateway_cpu_s"] - idle_from) / IDLE_WINDOW_S
        result = asyncio.run(replay(requests, [g.base_url for g in fleet.gateways], api_keys, MODEL_NAME,
                                    request_timeout_s, bar))
        time.sleep(SETTLE_S)
        after = _snapshot(fleet)
    record = run_record(spec, result, difference(before, after), idle_cpu_per_s, slos)
    record.update(pods_start_s=fleet.pods_start_s, gateways_start_s=fleet.gateways_start_s,
                  wall_s=time.monotonic() - started, router=router)
    return record
