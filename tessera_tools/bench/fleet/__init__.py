"""``tessera bench fleet``: many simulated engine pods behind real gateways,
routing policies compared as the fleet grows (docs/fleet-bench.md).

    tessera bench fleet --pods 16,64,128,256 --gateways 1,2 \\
        --output bench-results/fleet.json --plots bench-results/fleet

Each run starts fresh simulated pods (engine_pod/sim: the real scheduler
and KV cache manager, the forward replaced by a step-time profile) and
fresh gateways, replays one seeded trace of token-id requests through the
gateways' REST API, and reports hit rate, TTFT/ITL, goodput, gateway CPU
and prefix-query RPCs per request.
"""

from __future__ import annotations

import argparse

from tessera_operator.crd_engine import DOWN_STABILIZATIONS
from tessera_tools.bench.fleet.policies import POLICIES
from tessera_tools.bench.fleet.workload import WORKLOADS
from tessera_tools.bench.flags import (
    add_logs_arg, add_output_arg, non_negative_int, positive_float, positive_int, positive_int_list,
)

DEFAULT_PROFILE = "engine_pod/sim/profiles/bench-cpu.json"


def int_range(text: str) -> tuple[int, int]:
    """"300,700" -> (300, 700): an inclusive range of positive integers."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (integers), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return low, high


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def share(text: str) -> float:
    """A probability: a number in [0, 1]."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


SCENARIOS = ("routing", "autoscale", "faults")
SCALE_SIGNALS = ("queue", "ttft", "itl", "kvUsage", "concurrency")  # the CRD's signals of a mixed pool
# The pools of `--scenario autoscale --disaggregated`, and the defaults of the flags of each pool and of
# the mixed pool: fleet/scaling_policies.py refuses a flag of the mode not chosen when it is off its default.
PD_ROLES = ("prefill", "decode")
MIXED_FLAG_DEFAULTS = {"min_replicas": 1, "max_replicas": 8, "scale_signal": None, "scale_target": None}
PD_FLAG_DEFAULTS = {"min_replicas": 1, "max_replicas": 4, "scale_signal": None, "scale_target": None}


def _run(args: argparse.Namespace) -> int:
    # aiohttp, the workload, the operator's autoscaler: imported only when the command runs.
    if args.scenario == "autoscale":
        from tessera_tools.bench.fleet.autoscale_run import main
    elif args.scenario == "faults":
        from tessera_tools.bench.fleet.faults_run import main
    else:
        from tessera_tools.bench.fleet.runner import main
    return main(args)


def _add_pd_flags(group) -> None:
    group.add_argument("--disaggregated", action="store_true",
                       help="autoscale: a prefill pool and a decode pool (P/D through a redis-server the scenario "
                            "starts), each scaled on its own signal, instead of one mixed pool; the static fleet is "
                            "each pool at its --ROLE-max-replicas")
    d = PD_FLAG_DEFAULTS
    for role in PD_ROLES:
        group.add_argument(f"--{role}-min-replicas", type=non_negative_int, default=d["min_replicas"],
                           help=f"autoscale --disaggregated: fewest {role} pods")
        group.add_argument(f"--{role}-max-replicas", type=positive_int, default=d["max_replicas"],
                           help=f"autoscale --disaggregated: most {role} pods, and the static fleet's")
        group.add_argument(f"--{role}-scale-signal", choices=SCALE_SIGNALS, default=d["scale_signal"],
                           help=f"autoscale --disaggregated: the {role} pool's signal, one the CRD allows a {role} "
                                "pool (prefill: queue, ttft, concurrency; decode: itl, kvUsage, concurrency); "
                                "default the CRD's (prefill concurrency, decode kvUsage)")
        group.add_argument(f"--{role}-scale-target", type=positive_float, default=d["scale_target"],
                           help=f"autoscale --disaggregated: the {role} signal's target (default: the CRD's)")


def add_parser(kinds) -> None:
    p = kinds.add_parser("fleet", help="routing policies over many simulated pods behind real gateways")
    fleet = p.add_argument_group("fleet")
    fleet.add_argument("--model", default=None,
                       help="checkpoint whose config and tokenizer the pods and gateways use (default: models/bench "
                            "when built, else the tiny preset)")
    fleet.add_argument("--profile", default=DEFAULT_PROFILE, help="the pods' step-time profile (JSON)")
    fleet.add_argument("--pods", type=positive_int_list, default=[16, 64, 128, 256], help="fleet sizes, e.g. 16,64")
    fleet.add_argument("--pods-per-process", type=positive_int, default=16, help="simulated pods per engine process")
    fleet.add_argument("--gateways", type=positive_int_list, default=[1, 2],
                       help="gateway replicas (sharing nothing; requests alternate between them), e.g. 1,2")
    fleet.add_argument("--policies", default="round_robin,least_loaded,score,bounded,oracle",
                       help="routing policies (fleet/policies.py)")
    fleet.add_argument("--kv-blocks", type=positive_int, default=512, help="each pod's KV pool in blocks")
    fleet.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")

    load = p.add_argument_group("load")
    load.add_argument("--workloads", default="shared-prefix,no-reuse", help="shared-prefix, no-reuse")
    load.add_argument("--duration", type=positive_float, default=90.0, help="seconds of trace per run")
    load.add_argument("--load", type=positive_float, default=0.5,
                      help="steady offered load, a fraction of the fleet's capacity estimated from the profile "
                           "(cold: no cache hits); the spike doubles it")
    load.add_argument("--rate", type=positive_float, default=None, help="steady requests/s instead of --load")
    load.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    load.add_argument("--spike-factor", type=positive_float, default=2.0, help="the spike's rate over the steady one")
    load.add_argument("--seed", type=int, default=0, help="seed of the workload and the trace")

    work = p.add_argument_group("shared-prefix workload")
    work.add_argument("--tenants-per-pod", type=positive_float, default=0.5, help="tenants = pods x this (at least 2)")
    work.add_argument("--system-prompt-len", type=int_range, default=(300, 700), help="MIN,MAX tokens")
    work.add_argument("--user-len", type=int_range, default=(20, 120), help="MIN,MAX tokens per user message")
    work.add_argument("--output-len", type=int_range, default=(16, 64), help="MIN,MAX output tokens per turn")
    work.add_argument("--max-turns", type=positive_int, default=6, help="turns per conversation: 1 to this")
    work.add_argument("--think-time", type=positive_float, default=5.0, help="seconds at least between turns")
    work.add_argument("--new-conversation-share", type=share, default=0.3,
                      help="chance an arrival opens a conversation while one is ready to continue")
    work.add_argument("--tenant-skew", type=non_negative_float, default=0.5,
                      help="Zipf exponent of tenant traffic (0: uniform)")

    scenario = p.add_argument_group("scenarios (docs/fleet-bench.md)")
    scenario.add_argument("--scenario", choices=SCENARIOS, default="routing",
                          help="routing: the policy sweep; autoscale: the operator's decide() sets the pod count, "
                               "against a static fleet of --max-replicas; faults: SIGKILL 10%% of the pod processes "
                               "at the spike")
    scenario.add_argument("--scenario-policy", choices=tuple(POLICIES), default="bounded",
                          help="the routing policy of the autoscale and faults scenarios")
    scenario.add_argument("--scenario-workload", choices=WORKLOADS, default="shared-prefix",
                          help="the workload of the autoscale and faults scenarios (no-reuse: every prompt "
                               "uncached, so under --disaggregated every request goes through a prefill pod)")
    scenario.add_argument("--scale-interval", type=positive_float, default=5.0,
                          help="autoscale: seconds between the controller's decisions")
    mixed = MIXED_FLAG_DEFAULTS
    scenario.add_argument("--scale-signal", choices=SCALE_SIGNALS, default=mixed["scale_signal"],
                          help="autoscale: the pool's signal (the operator's; default the CRD's, concurrency)")
    scenario.add_argument("--scale-target", type=positive_float, default=mixed["scale_target"],
                          help="autoscale: the signal's target (default: the CRD's: queue 4, ttft 1.0 s, itl 0.05 s, "
                               "kvUsage 0.8, concurrency 8)")
    scenario.add_argument("--min-replicas", type=non_negative_int, default=mixed["min_replicas"],
                          help="autoscale: fewest pods (0: scale from zero, the gateways queue meanwhile)")
    scenario.add_argument("--max-replicas", type=positive_int, default=mixed["max_replicas"],
                          help="autoscale: most pods, and the static fleet's size")
    _add_pd_flags(scenario)
    scenario.add_argument("--scale-up-window", type=non_negative_float, default=0.0,
                          help="autoscale: scale-up stabilization seconds (the CRD's default: 0)")
    scenario.add_argument("--scale-down-window", type=non_negative_float, default=30.0,
                          help="autoscale: scale-down stabilization seconds (the CRD's 300 s is longer than a run)")
    scenario.add_argument("--max-scale-down-step", type=positive_int, default=None,
                          help="autoscale: most pods removed per decision (default: the CRD's maxScaleDownStep, 1)")
    scenario.add_argument("--scale-down-stabilization", choices=DOWN_STABILIZATIONS, default=None,
                          help="autoscale: how a scale-down reads its window: the highest recommendation (the HPA's) "
                               "or the mean demand (Knative's stable window); default the CRD's, highest")
    scenario.add_argument("--startup-delay", type=non_negative_float, default=10.0,
                          help="autoscale: seconds from a pod's start until it may be listed (model loading)")

    out = p.add_argument_group("results")
    out.add_argument("--slo", default="ttft=2000,itl=150",
                     help="goodput SLOs in ms: ttft, itl (a request's mean inter-token latency), e2el")
    out.add_argument("--request-timeout", type=positive_float, default=300.0,
                     help="seconds a request may wait for its next bytes before it counts as failed")
    add_output_arg(out, default="bench-results/fleet.json")
    out.add_argument("--plots", default=None, help="write PNG plots into this folder")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_logs_arg(out)
    p.set_defaults(bench_func=_run)
