"""``tessera bench serve --peer vllm``: Tessera's platform (an engine pod behind its gateway) and
vLLM's OpenAI server (`vllm serve`), both started by the command on the same checkpoint with
the same engine settings, measured on the same dataset, arrivals, rates and SLOs.

At each rate the two servers take turns (the order swaps every round), so a shared machine's
drift lands on both. Only one server has requests at a time; the other idles.

The verdict follows the issue's acceptance: the highest rate vLLM sustains (every request
completed, and completed requests/s at least `--sustained-fraction` of the offered rate), and
there Tessera's goodput over vLLM's and both TTFT p99s. Figures per rate are medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tessera_tools.bench.common import markdown_table, rotated, work_dir, write_report
from tessera_tools.bench.flags import core_count
from tessera_tools.bench.peers.vllm_peer import VLLMSettings
from tessera_tools.bench.peers.vllm_server import VLLMServer
from tessera_tools.bench.serve.client import ServeClient, Target
from tessera_tools.bench.serve.dataset import ServeRequest
from tessera_tools.bench.serve.metrics import percentile_key
from tessera_tools.bench.serve.report import rate_json
from tessera_tools.bench.serve.runner import Settings, build_dataset, measure_rate, parse_settings, resolve_target

SIDES = ("tessera", "vllm")
SERVED_MODEL_NAME = "bench"
# The medians a rate's comparison is made of (request_goodput only when SLOs are given).
COMPARED = ("offered_rate", "request_throughput", "output_throughput", "request_goodput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "failed")


def checkpoint_dtype(model: Path, dtype: str) -> str:
    """`dtype`, with "auto" resolved from the checkpoint's config.json as both engines would."""
    if dtype != "auto":
        return dtype
    config = json.loads((model / "config.json").read_text())
    return str(config.get("torch_dtype") or config.get("dtype") or "float32")


def peer_settings(args: argparse.Namespace) -> VLLMSettings:
    model = Path(args.serve_model).resolve()
    if not (model / "config.json").is_file():
        raise ValueError(f"--serve-model {args.serve_model}: no config.json there (a Hugging Face checkpoint folder)")
    dtype = checkpoint_dtype(model, args.dtype)
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype {dtype}: the comparison runs bfloat16 or float32 (vLLM's CPU build)")
    return VLLMSettings(model=str(model), dtype=dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, cpus=args.peer_cpus)


def tessera_pod_args(settings: VLLMSettings) -> list[str]:
    """The engine pod's flags for the settings vLLM gets: as many torch threads as vLLM has
    OpenMP threads, the same KV cache size."""
    args = ["--dtype", settings.dtype, "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(settings.kv_cache_gib << 30),
            "--cpu-threads", str(core_count(settings.cpus))]
    if settings.max_model_len:
        args += ["--max-model-len", str(settings.max_model_len)]
    if not settings.enable_prefix_caching:
        args.append("--no-prefix-caching")
    return args


def sustains(summary: dict, rate: float, fraction: float) -> bool:
    """Whether a run kept up with its offered rate: nothing failed, and completed requests/s
    reached `fraction` of the rate its arrivals offered (the drawn schedule's, where the summary
    has it, else the nominal one); an unbounded rate is never 'sustained'. Throughput counts the
    drain after the last arrival, so a run needs arrivals over many times its requests' latency."""
    if math.isinf(rate) or summary["failed"]:
        return False
    offered = summary.get("offered_rate") or rate
    return (summary["request_throughput"] or 0.0) >= fraction * offered


def median_of_rounds(summaries: list[dict]) -> dict:
    """Per compared figure, the median over a rate's rounds (None where a round has none);
    failed requests: the most of any round, so one bad round is never hidden."""
    medians = {}
    for key in COMPARED:
        values = [s.get(key) for s in summaries]
        if key == "failed":
            medians[key] = max(values)
        else:
            medians[key] = None if any(v is None for v in values) else statistics.median(values)
    return medians


def verdict(rates: list[float], by_side: dict[str, list[dict]], fraction: float) -> dict | None:
    """At the highest rate whose vLLM median run sustains it: the goodput ratio and both TTFT
    p99s. `by_side[side][i]` is the median figures at rates[i]. None: vLLM sustains none."""
    sustained = [i for i, rate in enumerate(rates) if sustains(by_side["vllm"][i], rate, fraction)]
    if not sustained:
        return None
    i = max(sustained, key=lambda k: rates[k])
    ours, theirs = by_side["tessera"][i], by_side["vllm"][i]
    goodput = (ours["request_goodput"], theirs["request_goodput"])
    return {"request_rate": rates[i], "tessera_goodput": goodput[0], "vllm_goodput": goodput[1],
            "goodput_ratio": goodput[0] / goodput[1] if goodput[0] is not None and goodput[1] else None,
            "tessera_p99_ttft_ms": ours["p99_ttft_ms"], "vllm_p99_ttft_ms": theirs["p99_ttft_ms"],
            "ttft_p99_no_worse": ours["p99_ttft_ms"] is not None and theirs["p99_ttft_ms"] is not None
            and ours["p99_ttft_ms"] <= theirs["p99_ttft_ms"]}


async def _sweep(args: argparse.Namespace, settings: Settings, requests: list[ServeRequest],
                 urls: dict[str, str]) -> dict[str, list[list[dict]]]:
    """summaries[side][rate index] = one summary per round."""
    runs: dict[str, list[list[dict]]] = {side: [[] for _ in settings.rates] for side in SIDES}
    async with contextlib.AsyncExitStack() as stack:
        clients = {side: await stack.enter_async_context(ServeClient(urls[side], None, args.request_timeout))
                   for side in SIDES}
        probe_args = argparse.Namespace(model=SERVED_MODEL_NAME, endpoint=args.endpoint,
                                        no_ignore_eos=args.no_ignore_eos)
        targets: dict[str, Target] = {side: await resolve_target(clients[side], probe_args, requests[0])
                                      for side in SIDES}
        for side in SIDES:  # first passes are slow on many servers; not measured
            for i in range(args.num_warmups):
                await clients[side].send(targets[side], requests[i % len(requests)])
        turn = 0
        for r, rate in enumerate(settings.rates):
            for round_index in range(args.rounds):
                for side in rotated(SIDES, turn):
                    # Quiet first: whichever server ran last may still be busy, and its tail of work would
                    # land on the first seconds of this run.
                    await asyncio.sleep(args.cooldown)
                    print(f"\n---- {side}, rate {rate:g} req/s, round {round_index + 1}/{args.rounds} ----")
                    _, summary = await measure_rate(clients[side], targets[side], requests, rate, args, settings)
                    runs[side][r].append(summary)
                turn += 1
    return runs


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_comparison(rates: list[float], by_side: dict[str, list[dict]], found: dict | None, fraction: float) -> None:
    header = ["rate (req/s)", "side", "req/s", "output tok/s", "goodput (req/s)", "TTFT median / p99 (ms)",
              "TPOT median / p99 (ms)", "sustained"]
    rows = []
    for i, rate in enumerate(rates):
        for side in SIDES:
            m = by_side[side][i]
            rows.append([f"{rate:g}", side, _fmt(m["request_throughput"]), _fmt(m["output_throughput"], 1),
                         _fmt(m["request_goodput"]), f"{_fmt(m['median_ttft_ms'], 1)} / {_fmt(m['p99_ttft_ms'], 1)}",
                         f"{_fmt(m['median_tpot_ms'], 1)} / {_fmt(m['p99_tpot_ms'], 1)}",
                         "yes" if sustains(m, rate, fraction) else "no"])
    print("\n" + markdown_table(header, rows))
    if found is None:
        print(f"\nvLLM sustains none of the rates (>= {fraction:.0%} of the offered rate, no failures)")
        return
    print(f"\nhighest rate vLLM sustains: {found['request_rate']:g} req/s; goodput tessera "
          f"{_fmt(found['tessera_goodput'])} vs vllm {_fmt(found['vllm_goodput'])} req/s "
          f"(ratio {_fmt(found['goodput_ratio'])}x); TTFT p99 {_fmt(found['tessera_p99_ttft_ms'], 1)} vs "
          f"{_fmt(found['vllm_p99_ttft_ms'], 1)} ms ({'no worse' if found['ttft_p99_no_worse'] else 'worse'})")


def start_tessera(settings: VLLMSettings, work: Path, stack, extra_pod_args: list[str] = (),
                  extra_gateway_config: dict | None = None) -> str:
    """One engine pod with `settings` (and `extra_pod_args`) behind a gateway (its config plus
    `extra_gateway_config`), both closed with `stack`; the gateway's API root."""
    pod_args = [*tessera_pod_args(settings), *extra_pod_args]
    pod = stack.enter_context(EnginePodProcess(settings.model, pod_args, log_path=work / "pod.log"))
    pod.wait_serving(timeout=600)
    model = {"name": SERVED_MODEL_NAME, "path": settings.model}
    if settings.max_model_len:
        model["max_model_len"] = settings.max_model_len
    config = {"model": model, "pods": {"static": [{"address": pod.address, "role": "mixed"}]},
              **(extra_gateway_config or {})}
    gateway = stack.enter_context(GatewayProcess(config, work, log_path=work / "gateway.log"))
    gateway.wait_ready(num_pods=1)
    return gateway.base_url + "/v1"


def main(args: argparse.Namespace) -> int:
    try:
        if not args.goodput:
            raise ValueError("--peer vllm compares goodput: give the SLOs with --goodput, e.g. ttft:2000 tpot:200")
        if not 0 < args.sustained_fraction <= 1:
            raise ValueError(f"--sustained-fraction {args.sustained_fraction}: a share of the rate, in (0, 1]")
        peer = peer_settings(args)
        settings = parse_settings(args)
        if 99.0 not in settings.percentiles:  # the verdict compares TTFT p99
            settings = replace(settings, percentiles=[*settings.percentiles, 99.0])
        args.tokenizer = args.tokenizer or peer.model
        requests = build_dataset(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with work_dir(args.logs, "tessera-bench-serve-peer-") as work:
        try:
            with contextlib.ExitStack() as stack:
                tessera_url = start_tessera(peer, work, stack)
                server = stack.enter_context(VLLMServer(peer, SERVED_MODEL_NAME, log_path=work / "vllm.log"))
                server.wait_ready()
                print(f"tessera at {tessera_url}, vllm at {server.base_url} ({peer.dtype}, "
                      f"{peer.max_num_seqs} seqs, {peer.max_num_batched_tokens} tokens a step; logs in {work})")
                runs = asyncio.run(_sweep(args, settings, requests, {"tessera": tessera_url,
                                                                     "vllm": server.base_url}))
        except Exception as e:  # a server that does not start or answer: say so, no traceback
            print(f"error: {type(e).__name__}: {e} (logs in {work})", file=sys.stderr)
            return 1
    by_side = {side: [median_of_rounds(rounds) for rounds in runs[side]] for side in SIDES}
    found = verdict(settings.rates, by_side, args.sustained_fraction)
    print_comparison(settings.rates, by_side, found, args.sustained_fraction)
    tail = percentile_key(settings.tail)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "peer": {"name": "vllm", "settings": asdict(peer)}, "endpoint": args.endpoint,
        "dataset": args.dataset_path or "synthetic-sharegpt", "num_prompts": len(requests),
        "max_prompt_len": None if args.dataset_path else args.max_prompt_len,
        "max_output_len": None if args.dataset_path else args.max_output_len, "seed": args.seed,
        "burstiness": args.burstiness, "rounds": args.rounds, "goodput_slos_ms": settings.slos,
        "sustained_fraction": args.sustained_fraction, "cooldown_s": args.cooldown, "tail_percentile": tail,
        "rates": [rate_json(r) for r in settings.rates],
        "medians": by_side, "runs": runs, "verdict": found,
    }
    write_report(report, args.output_json)
    return 0
