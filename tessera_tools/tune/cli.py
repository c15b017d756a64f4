"""``tessera tune -f inferenceservice.yaml --slo e2el:p99:2000``: the command."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tessera_tools.bench.flags import positive_float
from tessera_tools.tune.knobs import KNOWN, Knob, check_mode, current, default_knobs, parse_knob
from tessera_tools.tune.search import Trial, best_of, search
from tessera_tools.tune.slo import parse_slo


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="find the engine settings with the most goodput that holds SLOs, "
                                    "by running them here")
    p.add_argument("-f", "--file", required=True, help="the InferenceService YAML to tune")
    p.add_argument("--models-dir", default="models", help="local folder standing in for the model PVC (tessera up)")
    p.add_argument("--slo", action="append", default=[], required=True,
                   help="METRIC:pNN:MS, e.g. e2el:p99:2000 or ttft:p90:500 (ttft, itl, tpot, e2el); repeatable")
    p.add_argument("--knob", action="append", default=[],
                   help="NAME or NAME=V1,V2,... to search: " + ", ".join(KNOWN) + " (the replicas of a "
                        "disaggregated service's pools; default: every knob its mode has, with "
                        + "; ".join(f"{k}={','.join(map(str, v[1]))}" for k, v in KNOWN.items()) + ")")
    p.add_argument("--request-rates", default="1,2,4",
                   help="requests/s to try, ascending (a single value: a target rate)")
    p.add_argument("--num-prompts", type=int, default=50, help="requests per rate")
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--dataset", default=None, help="JSONL of requests instead of the synthetic ones "
                                                   "(tessera bench serve's format)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=positive_float, default=300.0, help="seconds each start may take")
    p.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="simulated engine pods with this step-time profile (engine_pod/sim/profiles): fleet-scale "
                        "questions (many replicas, a GPU's step times) on this machine")
    p.add_argument("--output-dir", default=None, help="where the patch, report and plots go "
                                                      "(default: bench-results/tune-NAME)")
    p.set_defaults(func=main)


def _inputs(args: argparse.Namespace):
    """Everything checked before a platform starts: exits 2 on the first bad input."""
    from tessera_operator.validation import validate_inference_service
    from tessera_tools.bench.serve.arrivals import parse_rates
    from tessera_tools.up.plan import local_model_path
    from tessera_tools.up.runner import load_resource

    slos = [parse_slo(s) for s in args.slo]
    knobs = [parse_knob(k) for k in args.knob]
    if len({k.name for k in knobs}) != len(knobs):
        raise ValueError("--knob: each knob once")
    rates = parse_rates(args.request_rates)
    if rates != sorted(rates):
        raise ValueError(f"--request-rates {args.request_rates}: give them ascending")
    if args.num_prompts < 1 or args.max_prompt_len < 1 or args.max_output_len < 1:
        raise ValueError("--num-prompts, --max-prompt-len and --max-output-len must be >= 1")
    resource = load_resource(args.file)
    spec = validate_inference_service(resource)["spec"]
    model_path = local_model_path(spec["model"], Path(args.models_dir))
    if not (model_path / "config.json").is_file():
        raise ValueError(f"spec.model: no checkpoint at {model_path} (pass --models-dir)")
    if args.simulate and not Path(args.simulate).is_file():
        raise ValueError(f"--simulate {args.simulate}: no such profile")
    knobs = knobs or default_knobs(spec["mode"])
    check_mode(knobs, spec["mode"])
    start = {k.name: current(spec, k) for k in knobs}
    return resource, spec, model_path, slos, knobs, rates, start


def _requests(args: argparse.Namespace, model_path: Path):
    from tessera.text.tokenizer import load_tokenizer
    from tessera_tools.bench.serve.dataset import load_jsonl, synthetic_requests

    tokenizer = load_tokenizer(model_path)
    if args.dataset:
        return load_jsonl(args.dataset, args.num_prompts, tokenizer)
    return synthetic_requests(tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len, args.seed)


def _describe(trial: Trial) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in trial.settings.items())
    if "error" in trial.detail:
        return f"{settings}: did not run ({trial.detail['error']})"
    runs = trial.detail["rates"]
    held = [r["request_rate"] for r in runs if not r["misses"]]
    last = runs[-1]
    tail = f"; at {last['request_rate']:g}/s: {', '.join(last['misses'])}" if last["misses"] else ""
    return (f"{settings}: goodput {trial.goodput:.2f} req/s, SLOs held up to "
            f"{max(held) if held else 'no rate'}{'/s' if held else ''}{tail}")


def main(args: argparse.Namespace) -> int:
    from tessera_tools.tune.report import write_outputs
    from tessera_tools.tune.trial import Workload, run_trial

    try:
        resource, spec, model_path, slos, knobs, rates, start = _inputs(args)
        requests = _requests(args, model_path)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workload = Workload(requests, rates, slos, spec["model"]["name"], args.seed)
    name = resource["metadata"]["name"]
    out = Path(args.output_dir or f"bench-results/tune-{name}")
    print(f"tuning {name}: {', '.join(str(s) for s in slos)}; rates {rates} req/s, {len(requests)} requests each; "
          f"knobs " + "; ".join(f"{k.name} in {list(k.values)}" for k in knobs))
    count = 0

    def evaluate(settings: dict[str, int]) -> Trial:
        nonlocal count
        count += 1
        with tempfile.TemporaryDirectory(prefix="tessera-tune-") as work:
            trial = run_trial(resource, settings, workload, args.models_dir, Path(work), args.ready_timeout,
                              args.simulate)
        print(f"[trial {count}] {_describe(trial)}", flush=True)
        return trial

    trials = search(knobs, start, evaluate)
    best, first = best_of(trials), trials[0]
    summary = {"resource": name, "slos": [str(s) for s in slos], "rates": rates, "num_prompts": len(requests),
               "grid_size": _grid_size(knobs), "trials_run": len(trials)}
    if not best.meets:
        print(f"error: no setting tried met {', '.join(str(s) for s in slos)} at any of {rates} req/s "
              f"({len(trials)} trials); lower the rates, loosen the SLOs or add capacity", file=sys.stderr)
        write_outputs(out, resource, best, first, trials, knobs, {**summary, "met": False})
        return 1
    ratio = best.goodput / first.goodput if first.meets and first.goodput > 0 else None
    summary.update(met=True, goodput_vs_start=ratio)
    paths = write_outputs(out, resource, best, first, trials, knobs, summary)
    versus = (f"{ratio:.2f}x the resource's own settings" if ratio is not None
              else "the resource's own settings met no SLO")
    print(f"best: {', '.join(f'{k}={v}' for k, v in best.settings.items())}: goodput {best.goodput:.2f} req/s "
          f"({versus}); {len(trials)} of {_grid_size(knobs)} grid points run")
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


def _grid_size(knobs: list[Knob]) -> int:
    size = 1
    for knob in knobs:
        size *= len(knob.values)
    return size
