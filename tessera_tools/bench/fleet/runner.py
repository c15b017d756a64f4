"""`tessera bench fleet`: every (fleet size, gateway replicas, workload,
policy) run in turn, policies in an order that rotates from one group to
the next; then the table, the JSON report and the plots."""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from engine_pod.sim.step_profile import COEFFICIENTS, StepTimeProfile
from tessera.context_length import read_config, resolve_max_model_len
from tessera.text import load_eos_token_ids
from tessera_tools.bench.common import resolve_model, rotated, work_dir, write_report
from tessera_tools.bench.fleet.fleet import FleetSettings, tenant_keys, write_tenants_file
from tessera_tools.bench.fleet.policies import POLICIES, parse_policies
from tessera_tools.bench.fleet.report import SOURCES, RunSpec, one_line, runs_table
from tessera_tools.bench.fleet.run import run_one
from tessera_tools.bench.fleet.sweep import FleetSizePlan, LoadSettings, plan_fleet_size
from tessera_tools.bench.fleet.workload import WORKLOADS, WorkloadSpec
from tessera_tools.bench.serve.metrics import parse_slos

BENCH_MODEL = Path("models/bench")
# serve's SLO names, as this command's --slo spells them: itl bounds a
# request's mean inter-token latency, which serve calls TPOT.
SLO_NAMES = {"ttft": "ttft", "itl": "tpot", "tpot": "tpot", "e2el": "e2el"}


def parse_slo_flag(text: str) -> dict[str, float]:
    """"ttft=2000,itl=150" -> serve's {"ttft": 2000.0, "tpot": 150.0} (ms)."""
    specs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--slo {part!r}: expected NAME=MS with NAME one of {', '.join(SLO_NAMES)}")
        specs.append(f"{SLO_NAMES[name]}:{value}")
    try:
        return parse_slos(specs)
    except ValueError as e:
        raise ValueError(f"--slo {text!r} (as serve's SLOs): {e}") from None


def parse_workloads(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in WORKLOADS for n in names):
        raise ValueError(f"--workloads {text!r}: expected names from {', '.join(WORKLOADS)}")
    return names


def model_path(flag: str | None) -> Path:
    """--model, else models/bench (make bench-models) when built, else the
    tiny preset: a simulated pod reads only the checkpoint's config and
    tokenizer, so any of them serves."""
    if flag:
        return resolve_model(flag)
    return BENCH_MODEL if (BENCH_MODEL / "config.json").is_file() else resolve_model(None)


def max_model_len(args: argparse.Namespace, model: Path) -> int:
    """The checkpoint's context limit, capped at one pod's KV pool (a pod
    refuses to start with a pool smaller than one whole sequence)."""
    return min(resolve_max_model_len(None, read_config(model)), args.kv_blocks * args.block_size)


def workload_spec(args: argparse.Namespace, pods: int, model: Path) -> WorkloadSpec:
    return WorkloadSpec(
        tenants=max(2, math.ceil(pods * args.tenants_per_pod)), vocab_size=int(read_config(model)["vocab_size"]),
        eos_token_ids=frozenset(load_eos_token_ids(model)), max_model_len=max_model_len(args, model),
        system_prompt_len=args.system_prompt_len, user_len=args.user_len, output_len=args.output_len,
        max_turns=args.max_turns, new_conversation_share=args.new_conversation_share, think_s=args.think_time,
        tenant_skew=args.tenant_skew)


def _settings_record(args: argparse.Namespace, policies: list[str], workloads: list[str],
                     slos: dict[str, float]) -> dict:
    keys = ("pods", "pods_per_process", "gateways", "duration", "load", "rate", "burstiness", "spike_factor", "seed",
            "kv_blocks", "block_size", "tenants_per_pod", "request_timeout")
    return {**{k: getattr(args, k) for k in keys}, "policies": policies, "workloads": workloads, "slos_ms": slos}


def _spec_record(spec: WorkloadSpec) -> dict:
    return {k: sorted(v) if isinstance(v, frozenset) else v for k, v in asdict(spec).items()}


def _sweep(args, plans: list[FleetSizePlan], settings: FleetSettings, keys: list[str], policies: list[str],
           workloads: list[str], slos: dict[str, float], work: Path) -> list[dict]:
    total = len(plans) * len(args.gateways) * len(workloads) * len(policies)
    runs: list[dict] = []
    group = 0
    for plan in plans:
        for gateways in args.gateways:
            for workload in workloads:
                for policy in rotated(policies, group):
                    spec = RunSpec(plan.pods, gateways, workload, policy)
                    requests = plan.requests[workload]
                    bar = tqdm(total=len(requests), unit="req", disable=args.no_progress, leave=False,
                               desc=f"[{len(runs) + 1}/{total}] {plan.pods} pods, {gateways} gw, {workload}, {policy}")
                    try:
                        run = run_one(spec, requests, settings, keys, slos, work / spec.tag, args.request_timeout, bar)
                    except Exception as e:  # a fleet that fails to start costs this run, not the sweep
                        run = {**asdict(spec), "error": f"{type(e).__name__}: {e}"[:500]}
                    finally:
                        bar.close()
                    run["order"] = len(runs)
                    runs.append(run)
                    tqdm.write(one_line(run))
                group += 1
    return runs


def main(args: argparse.Namespace) -> int:
    try:
        policies, workloads = parse_policies(args.policies), parse_workloads(args.workloads)
        slos = parse_slo_flag(args.slo)
        model = model_path(args.model)
        profile = StepTimeProfile.load(args.profile)
        load = LoadSettings(args.duration, args.load, args.rate, args.burstiness, args.spike_factor, args.seed)
        plans = [plan_fleet_size(profile, workload_spec(args, n, model), n, load, workloads) for n in args.pods]
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for plan in plans:
        t = plan.as_dict()
        print(f"{plan.pods} pods: {t['tenants']} tenants, capacity ~{t['fleet_capacity_rps']:.2f} req/s, steady "
              f"{plan.steady_rate:.2f} req/s ({t['offered_load']:.0%}), {t['requests']} requests")
    with work_dir(args.logs, "tessera-bench-fleet-") as work:
        keys = tenant_keys(max(p.spec.tenants for p in plans))
        settings = FleetSettings(model, Path(args.profile), args.pods_per_process, args.kv_blocks, args.block_size,
                                 max_model_len(args, model), write_tenants_file(work / "tenants.yaml", keys))
        runs = _sweep(args, plans, settings, keys, policies, workloads, slos, work)
    print("\n" + runs_table(runs))
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": str(model), "profile": str(args.profile),
        "profile_coefficients": {c: getattr(profile, c) for c in COEFFICIENTS}, "profile_source": profile.source,
        "settings": _settings_record(args, policies, workloads, slos),
        "workload_spec": {str(p.pods): _spec_record(p.spec) for p in plans},
        "policies": {name: {"router": POLICIES[name].router, "note": POLICIES[name].note} for name in policies},
        "sources": SOURCES,
        "traces": {str(p.pods): p.as_dict() for p in plans},
        "runs": runs,
    }
    write_report(report, args.output)
    if args.plots:
        from tessera_tools.bench.fleet.plots import write_plots  # matplotlib: only when asked

        for path in write_plots(runs, args.plots):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in runs) else 0
