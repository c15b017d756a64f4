"""``tessera bench serve --background-batch N``: what a batch job running in
the background costs interactive requests, and what it gets done.

At each rate the interactive requests run twice per round, alone and with a
batch of N lines started first through the Batch API (the order swaps every
round, so a shared machine's drift lands on both). The batch is cancelled
when the interactive run ends. Reported: interactive TTFT/ITL percentiles of
both runs, their ratio, and the batch's tokens/s (background_batch.py).

The target is a gateway with the Batch API on (`--base-url`, `--api-key`),
or, with `--serve-model`, an engine pod and a gateway the command starts: the
pod with `--scheduling-policy priority --background-priority` set to the
batch class's priority (`--no-background-yield` leaves that out, to see what
the engine's yielding buys), the gateway with a batch section and two
tenants, one per kind of traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import secrets
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from gateway.priority import BUILTIN_CLASSES
from gateway.tenants import hash_api_key
from tessera_tools.bench.common import markdown_table, rotated, work_dir, write_report
from tessera_tools.bench.serve.background_batch import BackgroundBatch, batch_input
from tessera_tools.bench.serve.client import ServeClient
from tessera_tools.bench.serve.dataset import ServeRequest, synthetic_requests
from tessera_tools.bench.serve.peer import SERVED_MODEL_NAME, peer_settings, start_tessera, tessera_pod_args
from tessera_tools.bench.serve.runner import Settings, build_dataset, measure_rate, parse_settings, resolve_target

MODES = ("alone", "with-batch")
# The figures compared between the two modes (medians over rounds).
COMPARED = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput", "failed")
# The priority class batch lines run at on a started gateway: the built-in sheddable one.
BATCH_CLASS = next(c for c in BUILTIN_CLASSES if c.sheddable)
# Dataset seed offset of the batch's lines, so they are not the interactive prompts (no cache hits).
BATCH_SEED_OFFSET = 1000


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def compare(runs: dict[str, list[dict]], batches: list[dict]) -> dict:
    """Medians over rounds per mode, the with/alone ratios of TTFT, and the batch's median figures."""
    medians = {mode: {key: (max(s[key] for s in runs[mode]) if key == "failed"
                            else _median([s.get(key) for s in runs[mode]])) for key in COMPARED} for mode in MODES}
    alone, loaded = medians["alone"], medians["with-batch"]

    def ratio(key: str) -> float | None:
        return loaded[key] / alone[key] if loaded[key] is not None and alone[key] else None

    return {"medians": medians, "p99_ttft_ratio": ratio("p99_ttft_ms"), "median_ttft_ratio": ratio("median_ttft_ms"),
            "p99_itl_ratio": ratio("p99_itl_ms"),
            "batch_output_tokens_per_s": _median([b["output_tokens_per_s"] for b in batches]),
            "batch_total_tokens_per_s": _median([b["total_tokens_per_s"] for b in batches]),
            "batch_lines_completed": _median([b["lines_completed"] for b in batches])}


def build_datasets(args: argparse.Namespace) -> tuple[list[ServeRequest], list[ServeRequest]]:
    """The interactive requests (the command's dataset) and the batch's (synthetic, another seed)."""
    from tessera_tools.bench.serve.runner import _tokenizer

    batch_requests = synthetic_requests(_tokenizer(args, needed=True), args.background_batch, args.max_prompt_len,
                                        args.background_max_tokens, args.seed + BATCH_SEED_OFFSET)
    return build_dataset(args), batch_requests


async def _sweep(args: argparse.Namespace, settings: Settings, base_url: str, keys: dict[str, str],
                 requests: list[ServeRequest], batch_requests: list[ServeRequest]) -> list[dict]:
    results = []
    async with ServeClient(base_url, keys["interactive"], args.request_timeout) as client, \
            ServeClient(base_url, keys["batch"], args.request_timeout) as batch_client:
        target = await resolve_target(client, args, requests[0])
        content = batch_input(target, batch_requests, args.background_max_tokens)
        for i in range(args.num_warmups):
            await client.send(target, requests[i % len(requests)])
        turn = 0
        for rate in settings.rates:
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            batches: list[dict] = []
            for round_index in range(args.rounds):
                for mode in rotated(MODES, turn):
                    await asyncio.sleep(args.cooldown)
                    print(f"\n---- {mode}, rate {rate:g} req/s, round {round_index + 1}/{args.rounds} ----")
                    batch = BackgroundBatch(batch_client, content) if mode == "with-batch" else None
                    if batch is not None:
                        await batch.start()
                        await asyncio.sleep(args.background_warmup)  # the batch reaches its steady state
                    _, summary = await measure_rate(client, target, requests, rate, args, settings)
                    runs[mode].append(summary)
                    if batch is not None:
                        figures = (await batch.stop()).as_json()
                        print(f"background batch: {figures}")
                        batches.append(figures)
                turn += 1
            results.append({"request_rate": rate, "runs": runs, "batches": batches, **compare(runs, batches)})
    return results


def _fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_results(results: list[dict]) -> None:
    header = ["rate (req/s)", "TTFT median alone / with (ms)", "TTFT p99 alone / with (ms)", "p99 ratio",
              "ITL p99 alone / with (ms)", "batch output tok/s", "batch lines done"]
    rows = []
    for r in results:
        a, w = r["medians"]["alone"], r["medians"]["with-batch"]
        rows.append([f"{r['request_rate']:g}", f"{_fmt(a['median_ttft_ms'])} / {_fmt(w['median_ttft_ms'])}",
                     f"{_fmt(a['p99_ttft_ms'])} / {_fmt(w['p99_ttft_ms'])}", f"{_fmt(r['p99_ttft_ratio'], 2)}x",
                     f"{_fmt(a['p99_itl_ms'])} / {_fmt(w['p99_itl_ms'])}", _fmt(r["batch_output_tokens_per_s"]),
                     _fmt(r["batch_lines_completed"], 0)])
    print("\n" + markdown_table(header, rows))


def _write_tenants(work: Path) -> tuple[str, dict[str, str]]:
    """Two tenants, one per kind of traffic; their keys live in this process only."""
    keys = {"interactive": secrets.token_urlsafe(24), "batch": secrets.token_urlsafe(24)}
    entries = [{"name": name, "api_key_sha256": [hash_api_key(key)]} for name, key in keys.items()]
    path = work / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": entries}))
    return str(path), keys


def _start_platform(args: argparse.Namespace, work: Path,
                    stack: contextlib.ExitStack) -> tuple[str, dict[str, str], list[str]]:
    settings = peer_settings(args)
    extra_pod_args = ["--scheduling-policy", "priority"]
    if not args.no_background_yield:
        extra_pod_args += ["--background-priority", str(BATCH_CLASS.priority),
                           "--background-max-batched-tokens", str(args.background_max_batched_tokens)]
    tenants_file, keys = _write_tenants(work)
    batch = {"directory": str(work / "batch-store"), "priority_class": BATCH_CLASS.name,
             "max_concurrency": args.background_concurrency, "poll_interval_s": 0.2, "retry_interval_s": 0.2}
    base_url = start_tessera(settings, work, stack, extra_pod_args, {"tenants_file": tenants_file, "batch": batch})
    pod_args = [*tessera_pod_args(settings), *extra_pod_args]
    print(f"engine pod {' '.join(pod_args)}; gateway {base_url}; logs in {work}")
    return base_url, keys, pod_args


def main(args: argparse.Namespace) -> int:
    try:
        settings = parse_settings(args)
        if 99.0 not in settings.percentiles:  # the comparison is of TTFT p99
            settings = replace(settings, percentiles=[*settings.percentiles, 99.0])
        if args.serve_model:
            args.tokenizer = args.tokenizer or str(Path(args.serve_model).resolve())
            args.model = SERVED_MODEL_NAME
        requests, batch_requests = build_datasets(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with work_dir(args.logs, "tessera-bench-serve-background-") as work:
        try:
            with contextlib.ExitStack() as stack:
                pod_args = None
                if args.serve_model:
                    base_url, keys, pod_args = _start_platform(args, work, stack)
                else:
                    key = args.api_key or os.environ.get("OPENAI_API_KEY")
                    base_url, keys = args.base_url, {"interactive": key, "batch": key}
                results = asyncio.run(_sweep(args, settings, base_url, keys, requests, batch_requests))
        except Exception as e:  # a server that does not start, or a batch the gateway refuses: say so
            print(f"error: {type(e).__name__}: {e} (logs in {work})", file=sys.stderr)
            return 1
    print_results(results)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": None if args.serve_model else args.base_url, "serve_model": args.serve_model,
        "engine_args": pod_args, "batch_priority_class": BATCH_CLASS.name if args.serve_model else None,
        "background_batch_lines": args.background_batch, "background_max_tokens": args.background_max_tokens,
        "background_concurrency": args.background_concurrency, "endpoint": args.endpoint,
        "num_prompts": args.num_prompts, "max_prompt_len": args.max_prompt_len,
        "max_output_len": args.max_output_len, "seed": args.seed, "rounds": args.rounds,
        "cooldown_s": args.cooldown, "warmup_s": args.background_warmup, "results": results,
    }
    write_report(report, args.output_json)
    return 0
