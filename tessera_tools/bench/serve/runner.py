"""`tessera bench serve`: the dataset, a check of the endpoint, then one
open-loop run per request rate; results as a table, JSON and plots."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from tessera_tools.bench.serve.arrivals import arrival_offsets, offered_rate, parse_rates
from tessera_tools.bench.serve.client import ServeClient, Target
from tessera_tools.bench.serve.dataset import (
    ServeRequest,
    check_endpoint,
    load_jsonl,
    synthetic_requests,
    with_prefix_groups,
)
from tessera_tools.bench.serve.load import RateRun, run_at_rate
from tessera_tools.bench.serve.metrics import parse_percentiles, parse_slos, summarize
from tessera_tools.bench.common import write_report
from tessera_tools.bench.serve.report import print_rate, print_sweep_table, rate_json, request_records


@dataclass(frozen=True)
class Settings:
    """The command's flags, parsed and checked before anything is sent."""

    rates: list[float]
    percentiles: list[float]
    slos: dict[str, float]

    @property
    def tail(self) -> float:
        """The percentile the sweep table and plots show next to the median."""
        return 99.0 if 99.0 in self.percentiles else max(self.percentiles)


def parse_settings(args: argparse.Namespace) -> Settings:
    """The flags argparse cannot check alone (the numeric ones have types in
    serve/__init__.py)."""
    rates = parse_rates(args.request_rates or args.request_rate)
    return Settings(rates, parse_percentiles(args.metric_percentiles), parse_slos(args.goodput or []))


def _tokenizer(args: argparse.Namespace, needed: bool):
    """The tokenizer that measures prompt lengths: --tokenizer, else (when the
    dataset needs one) the tokenizer of Tessera's preset checkpoints."""
    from tessera.text import load_tokenizer

    if args.tokenizer:
        path = args.tokenizer
    elif needed:
        from tessera_tools.bench.common import resolve_model

        path = resolve_model(None)
        print(f"tokenizer: {path} (Tessera's preset tokenizer; pass --tokenizer for another model's)")
    else:
        return None
    tokenizer = load_tokenizer(path)
    # It only measures text here (the whole corpus at once, too): the
    # model's context limit does not apply, and its warning would be noise.
    tokenizer.model_max_length = int(1e30)
    return tokenizer


def build_dataset(args: argparse.Namespace) -> list[ServeRequest]:
    tokenizer = _tokenizer(args, needed=not args.dataset_path or bool(args.prefix_groups))
    if args.dataset_path:
        requests = load_jsonl(args.dataset_path, args.num_prompts, tokenizer)
    else:
        requests = synthetic_requests(tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len, args.seed)
    if args.prefix_groups:
        requests = with_prefix_groups(requests, tokenizer, args.prefix_groups, args.prefix_len, args.seed)
    check_endpoint(requests, args.endpoint)
    return requests


async def resolve_target(client: ServeClient, args: argparse.Namespace, probe: ServeRequest) -> Target:
    """The model (the server's first, unless given) and whether `ignore_eos`
    is taken: one short request tells, and fails loudly if nothing works."""
    model = args.model
    if not model:
        ids = await client.model_ids()
        if not ids:
            raise RuntimeError(f"GET {client.base_url}/models lists no model: pass --model")
        model = ids[0]
    target = Target(client.base_url, args.endpoint, model, ignore_eos=not args.no_ignore_eos)
    outcome = await client.send(target, probe, max_tokens=2)
    if not outcome.ok and target.ignore_eos and "ignore_eos" in outcome.error:
        print("the server refuses ignore_eos: output lengths are capped by max_tokens only", file=sys.stderr)
        target = replace(target, ignore_eos=False)
        outcome = await client.send(target, probe, max_tokens=2)
    if not outcome.ok:
        raise RuntimeError(f"a test request to {target.url} failed: {outcome.error}")
    return target


async def _run_sweep(args: argparse.Namespace, settings: Settings,
                     requests: list[ServeRequest]) -> tuple[Target, list[tuple[RateRun, dict]]]:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    async with ServeClient(args.base_url, api_key, args.request_timeout) as client:
        target = await resolve_target(client, args, requests[0])
        print(f"model {target.model} at {target.url}; {len(requests)} requests per rate; "
              f"ignore_eos {'on' if target.ignore_eos else 'off'}")
        for i in range(args.num_warmups):  # first passes are slow on many servers; not measured
            await client.send(target, requests[i % len(requests)])
        runs = [await measure_rate(client, target, requests, rate, args, settings) for rate in settings.rates]
    return target, runs


async def measure_rate(client: ServeClient, target: Target, requests: list[ServeRequest], rate: float,
                       args: argparse.Namespace, settings: Settings) -> tuple[RateRun, dict]:
    """One open-loop run at `rate`, summarized and printed."""
    # The same seed at every rate (and for every server): a sweep varies only the rate.
    offsets = arrival_offsets(len(requests), rate, args.burstiness, args.seed)
    run = await run_at_rate(client, target, requests, offsets, rate, args.max_concurrency,
                            progress=not args.disable_tqdm)
    summary = {"request_rate": rate_json(rate), "offered_rate": offered_rate(offsets, rate),
               "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
               **summarize(run.outcomes, run.duration_s, settings.percentiles, settings.slos)}
    print_rate(summary, settings.percentiles)
    return run, summary


def _write_plots(plot_dir: str, runs: list[tuple[RateRun, dict]], tail: float) -> list[Path]:
    from tessera_tools.bench.serve.plots import plot_distribution, plot_latency_vs_throughput

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_rate = [{**summary, "request_rate": run.request_rate} for run, summary in runs]
    ttft = {run.request_rate: [o.ttft_s * 1e3 for o in run.outcomes if o.ok] for run, _ in runs}
    itl = {run.request_rate: [g * 1e3 for o in run.outcomes if o.ok for g in o.itl_s] for run, _ in runs}
    return [plot_latency_vs_throughput(by_rate, tail, out / "latency_vs_throughput.png"),
            plot_distribution(ttft, "ttft", out / "ttft_distribution.png"),
            plot_distribution(itl, "itl", out / "itl_distribution.png")]


def main(args: argparse.Namespace) -> int:
    try:
        settings = parse_settings(args)
        requests = build_dataset(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        target, runs = asyncio.run(_run_sweep(args, settings, requests))
    except Exception as e:  # the endpoint is unreachable or refuses every request: say so, no traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print_sweep_table([summary for _, summary in runs], settings.tail)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": args.base_url, "endpoint": args.endpoint, "model": target.model,
        "dataset": args.dataset_path or "synthetic-sharegpt", "num_prompts": len(requests),
        "max_prompt_len": None if args.dataset_path else args.max_prompt_len,
        "max_output_len": None if args.dataset_path else args.max_output_len,
        "prefix_groups": args.prefix_groups, "prefix_len": args.prefix_len if args.prefix_groups else None,
        "seed": args.seed, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "ignore_eos": target.ignore_eos, "percentiles": settings.percentiles, "goodput_slos_ms": settings.slos,
        "runs": [{**summary, "requests": request_records(run.outcomes)} for run, summary in runs],
    }
    write_report(report, args.output_json)
    if args.plot_dir:
        for path in _write_plots(args.plot_dir, runs, settings.tail):
            print(f"wrote {path}")
    return 0
