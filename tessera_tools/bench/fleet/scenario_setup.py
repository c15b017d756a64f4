"""What the autoscale and faults scenarios set up alike from the flags: the
SLOs, the checkpoint and profile, the workload (--scenario-workload) on the
ramp/spike trace for a fleet of N pods, and the tenants' keys."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from engine_pod.sim.step_profile import COEFFICIENTS, StepTimeProfile
from tessera_tools.bench.fleet.fleet import FleetSettings, tenant_keys, write_tenants_file
from tessera_tools.bench.fleet.policies import POLICIES
from tessera_tools.bench.fleet.runner import max_model_len, model_path, parse_slo_flag, workload_spec
from tessera_tools.bench.fleet.sweep import FleetSizePlan, LoadSettings, PDPools, plan_fleet_size

@dataclass(frozen=True)
class Scenario:
    slos: dict[str, float]
    model: Path
    profile: StepTimeProfile
    plan: FleetSizePlan
    """The trace and requests, sized for `plan.pods` (the static fleet)."""
    router: dict
    """The gateways' `router` section (--scenario-policy)."""
    workload: str
    """A name of workload.WORKLOADS (--scenario-workload)."""

    @property
    def requests(self):
        return self.plan.requests[self.workload]


def plan_scenario(args: argparse.Namespace, pods: int, pd: PDPools | None = None) -> Scenario:
    """The trace sized for `pods` mixed pods, or for the pools `pd`; ValueError / OSError on a bad flag or
    file."""
    slos = parse_slo_flag(args.slo)
    model = model_path(args.model)
    profile = StepTimeProfile.load(args.profile)
    load = LoadSettings(args.duration, args.load, args.rate, args.burstiness, args.spike_factor, args.seed)
    plan = plan_fleet_size(profile, workload_spec(args, pods, model), pods, load, [args.scenario_workload], pd)
    return Scenario(slos, model, profile, plan, POLICIES[args.scenario_policy].router, args.scenario_workload)


def fleet_settings(args: argparse.Namespace, scenario: Scenario, pods_per_process: int,
                   work: Path) -> tuple[FleetSettings, list[str]]:
    keys = tenant_keys(scenario.plan.spec.tenants)
    settings = FleetSettings(scenario.model, Path(args.profile), pods_per_process, args.kv_blocks, args.block_size,
                             max_model_len(args, scenario.model), write_tenants_file(work / "tenants.yaml", keys))
    return settings, keys


def common_record(args: argparse.Namespace, scenario: Scenario) -> dict:
    trace = scenario.plan.as_dict()
    return {"model": str(scenario.model), "profile": str(args.profile),
            "profile_coefficients": {c: getattr(scenario.profile, c) for c in COEFFICIENTS},
            "policy": args.scenario_policy, "router": scenario.router, "workload": scenario.workload, "trace": trace,
            "slos_ms": scenario.slos}


def describe(scenario: Scenario) -> str:
    t = scenario.plan.as_dict()
    sized = (f"{scenario.plan.pd.prefill} prefill + {scenario.plan.pd.decode} decode pods" if scenario.plan.pd
             else f"{scenario.plan.pods} pods")
    return (f"trace for {sized}: {t['tenants']} tenants, capacity ~{t['fleet_capacity_rps']:.2f} "
            f"req/s, steady {scenario.plan.steady_rate:.2f} req/s ({t['offered_load']:.0%}), {t['requests']} requests")
