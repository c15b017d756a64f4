"""``tessera bench routing``: the gateway's KV-aware scorer against round robin.

Two mixed engine pods behind a gateway serve many "users" who share 8
system prompts of ~1,024 tokens, each request one system prompt plus a
short suffix of its own. Requests arrive as a seeded Poisson process, the
same sequence for both policies, over the REST API (streaming, so the
client measures TTFT). Each policy gets fresh pods, so both start cold.

The pods' KV cache holds `--kv-prompts` requests' worth of tokens (default
4: half of the system prompts). Round robin sends every system prompt to
both pods, so each pod cycles through all 8 and keeps evicting; a router
that keeps each prompt on one pod lets the two caches together hold all 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tessera_tools.bench.common import markdown_table, resolve_model, rotated, work_dir, write_report
from tessera_tools.bench.flags import (
    add_logs_arg, add_model_args, add_output_arg, add_seed_arg, non_negative_int, positive_float, positive_int,
)
from tessera_tools.bench.stats import percentile
from tessera_tools.fixtures.tokenizer import corpus_lines

MODEL_NAME = "bench"
POLICIES = ("score", "round_robin")


def scrape(url: str, name: str, label: str | None = None) -> dict[str, float]:
    """Samples of one Prometheus metric, summed by `label`'s value ("" when None)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "") if label else ""
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


# -- the workload -------------------------------------------------------------
@dataclass(frozen=True)
class ScheduledRequest:
    arrival_s: float  # offset from the start of the run
    prompt_index: int  # which system prompt
    prompt_token_ids: list[int]


def _random_text_tokens(tokenizer, words: list[str], rng: random.Random, length: int) -> list[int]:
    """`length` tokens of seeded random corpus words (text, not random ids, so
    the prompts tokenize like language)."""
    tokens: list[int] = []
    while len(tokens) < length:
        text = " ".join(rng.choices(words, k=length))
        tokens += tokenizer.encode(" " + text, add_special_tokens=False)
    return tokens[:length]


def build_workload(tokenizer, num_prompts: int, prompt_len: int, suffix_len: int, num_requests: int,
                   rate: float, seed: int) -> list[ScheduledRequest]:
    rng = random.Random(seed)
    words = [w for line in corpus_lines() for w in line.split()]
    prompts = [_random_text_tokens(tokenizer, words, rng, prompt_len) for _ in range(num_prompts)]
    requests, clock = [], 0.0
    for _ in range(num_requests):
        clock += rng.expovariate(rate)
        index = rng.randrange(num_prompts)
        suffix = _random_text_tokens(tokenizer, words, rng, suffix_len)
        requests.append(ScheduledRequest(clock, index, prompts[index] + suffix))
    return requests


# -- the client -----------------------------------------------------------------
@dataclass
class RequestResult:
    prompt_index: int
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def stream_completion(session, url: str, prompt_token_ids: list[int], output_len: int,
                            result: RequestResult) -> RequestResult:
    """One streamed /v1/completions call; TTFT at the first chunk with a choice,
    usage (with cached tokens) from the last chunk."""
    body = {"model": MODEL_NAME, "prompt": prompt_token_ids, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                if chunk.get("choices") and math.isnan(result.ttft_s):
                    result.ttft_s = time.perf_counter() - start
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    except Exception as e:  # a failed request is reported, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    result.e2e_s = time.perf_counter() - start
    return result


async def replay(base_url: str, requests: list[ScheduledRequest], output_len: int,
                 max_concurrency: int) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival time (open loop), at most
    `max_concurrency` in flight when > 0. Returns results and wall seconds."""
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    url = base_url + "/v1/completions"

    async def one(session, r: ScheduledRequest, t0: float) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        result = RequestResult(r.prompt_index)
        if limit is None:
            return await stream_completion(session, url, r.prompt_token_ids, output_len, result)
        async with limit:
            return await stream_completion(session, url, r.prompt_token_ids, output_len, result)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(session, r, t0) for r in requests))
        return list(results), time.perf_counter() - t0


# -- one run: fresh pods, one policy ----------------------------------------------
@dataclass(frozen=True)
class RunSettings:
    model: Path
    pod_args: list[str]
    output_len: int
    max_concurrency: int
    warmup_len: int
    block_size: int
    pod_threads: int
    workdir: Path


def _warm_up(pod: EnginePodProcess, prompt_len: int, seed: int) -> None:
    """Two long prompts of random ids straight to the pod: torch's first
    passes are slow. Their blocks are the oldest in the cache, so LRU
    evicts them first; they never match a system prompt."""
    from tessera.internal_channel import InternalClient
    from tessera.v1 import engine_pb2 as pb
    from tessera.v1 import engine_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    with InternalClient.from_env().channel(pod.address) as channel:
        stub = pb_grpc.EngineStub(channel)
        for _ in range(2):
            ids = [rng.randrange(100, 4000) for _ in range(prompt_len)]
            params = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)):
                pass


def _pod_counters(pods: list[EnginePodProcess]) -> dict[str, tuple[float, float]]:
    """address -> (prefix-cache hit tokens, looked-up tokens) so far."""
    out = {}
    for pod in pods:
        url = f"http://127.0.0.1:{pod.metrics_port}/metrics"
        hits = scrape(url, "tessera_prefix_cache_hits_total")[""]
        queries = scrape(url, "tessera_prefix_cache_queries_total")[""]
        out[pod.address] = (hits, queries)
    return out


def run_policy(policy: str, requests: list[ScheduledRequest], s: RunSettings, tag: str) -> dict:
    work = s.workdir / tag
    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        # Each pod gets its share of the cores: torch's default (every core
        # per process) makes two pods' OpenMP threads fight, ~20x slower here.
        pod_args = [*s.pod_args, "--cpu-threads", str(s.pod_threads)]
        pods = [stack.enter_context(EnginePodProcess(s.model, pod_args, log_path=work / f"pod{i}.log"))
                for i in range(2)]
        for i, pod in enumerate(pods):
            pod.wait_serving()
            _warm_up(pod, s.warmup_len, seed=10_000 + i)
        config = {
            "model": {"name": MODEL_NAME, "path": str(s.model), "block_size": s.block_size},
            "pods": {"static": [{"address": p.address, "role": "mixed"} for p in pods]},
            "router": {"policy": policy},
        }
        gw = stack.enter_context(GatewayProcess(config, work, log_path=work / "gateway.log"))
        gw.wait_ready(num_pods=2)
        before = _pod_counters(pods)
        results, seconds = asyncio.run(replay(gw.base_url, requests, s.output_len, s.max_concurrency))
        after = _pod_counters(pods)
        routed = scrape(gw.metrics_url, "tessera_gateway_routing_decisions_total", "pod")
    return summarize(policy, results, seconds, before, after, routed)


def summarize(policy: str, results: list[RequestResult], seconds: float, before: dict, after: dict,
              routed: dict[str, float]) -> dict:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    pod_hits = sum(after[a][0] - before[a][0] for a in after)
    pod_queries = sum(after[a][1] - before[a][1] for a in after)
    errors = [r.error for r in results if r.error is not None]
    return {
        "policy": policy,
        "requests": len(results),
        "errors": len(errors),
        "first_errors": errors[:3],
        "seconds": seconds,
        "completed_per_second": len(ok) / seconds,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / max(1, prompt_tokens),
        "pod_counter_hit_rate": pod_hits / max(1.0, pod_queries),
        "mean_ttft_s": statistics.mean(ttfts) if ttfts else math.nan,
        "p50_ttft_s": percentile(ttfts, 50),
        "p99_ttft_s": percentile(ttfts, 99),
        "mean_e2e_s": statistics.mean(r.e2e_s for r in ok) if ok else math.nan,
        "requests_per_pod": sorted((int(v) for v in routed.values()), reverse=True),
        "per_request": [asdict(r) for r in results],
    }


def _pooled(runs: list[dict]) -> dict:
    """One policy's figures over all its rounds (request-weighted)."""
    reqs = [r for run in runs for r in run["per_request"] if r["error"] is None]
    ttfts = [r["ttft_s"] for r in reqs]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    return {
        "requests": len(reqs),
        "errors": sum(run["errors"] for run in runs),
        "hit_rate": sum(r["cached_tokens"] for r in reqs) / max(1, prompt),
        "pod_counter_hit_rate": statistics.mean(run["pod_counter_hit_rate"] for run in runs),
        "mean_ttft_s": statistics.mean(ttfts) if ttfts else math.nan,
        "p50_ttft_s": percentile(ttfts, 50),
        "p99_ttft_s": percentile(ttfts, 99),
        "mean_e2e_s": statistics.mean(r["e2e_s"] for r in reqs) if reqs else math.nan,
        "requests_per_pod": [run["requests_per_pod"] for run in runs],
    }


def _kv_cache_bytes(model: Path, dtype: str, block_size: int, tokens: int) -> tuple[int, int]:
    """Bytes (and blocks) of a KV pool holding `tokens` tokens, for the pods' dtype."""
    from engine_pod.config import create_engine_config
    from engine_pod.worker.kv_cache import bytes_per_block

    cfg = create_engine_config(model, dtype=dtype, block_size=block_size)
    blocks = math.ceil(tokens / block_size)
    return blocks * bytes_per_block(cfg.model.arch, block_size, cfg.model.dtype), blocks


def _print_summary(report: dict) -> None:
    w = report["workload"]
    print(f"\n{w['requests']} requests at {w['rate']}/s (Poisson, seed {w['seed']}), {w['system_prompts']} system "
          f"prompts x {w['prompt_len']} tokens + {w['suffix_len']}-token suffix, {w['output_len']} output tokens; "
          f"KV cache per pod {report['kv_cache_bytes_per_pod']:,} bytes = {report['kv_blocks_per_pod']} blocks "
          f"= {w['kv_prompts']} requests' worth; {len(report['rounds'])} round(s)\n")
    header = ("policy", "hit rate (usage)", "hit rate (pod counters)", "mean TTFT", "p50 TTFT", "p99 TTFT", "mean e2e",
              "requests per pod", "errors")
    rows = [[policy, f"{p['hit_rate']:.1%}", f"{p['pod_counter_hit_rate']:.1%}",
             *(f"{p[key] * 1e3:.1f} ms" for key in ("mean_ttft_s", "p50_ttft_s", "p99_ttft_s", "mean_e2e_s")),
             p["requests_per_pod"], p["errors"]]
            for policy, p in report["pooled"].items()]
    print(markdown_table(header, rows))
    r = report["ratios"]
    print(f"\nscorer / round robin: hit rate {r['hit_rate_score_over_rr']:.2f}x (target >= 1.5x); "
          f"mean TTFT {r['mean_ttft_rr_over_score']:.2f}x lower (target > 1x)")


def main(args: argparse.Namespace) -> int:
    from tessera.text import load_tokenizer

    model = resolve_model(args.model)
    tokenizer = load_tokenizer(model)
    requests = build_workload(tokenizer, args.system_prompts, args.prompt_len, args.suffix_len,
                              args.num_requests, args.rate, args.seed)
    request_tokens = args.prompt_len + args.suffix_len + args.output_len
    kv_bytes, kv_blocks = _kv_cache_bytes(model, args.dtype, args.block_size,
                                          int(args.kv_prompts * request_tokens))
    pod_args = ["--dtype", args.dtype, "--block-size", str(args.block_size), "--kv-cache-memory-bytes", str(kv_bytes)]
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    with work_dir(args.logs, "tessera-bench-routing-") as work:
        settings = RunSettings(model, pod_args, args.output_len, args.max_concurrency,
                               args.prompt_len + args.suffix_len, args.block_size, args.pod_threads, work)
        for round_ in range(args.rounds):
            for policy in rotated(POLICIES, round_):
                run = run_policy(policy, requests, settings, f"round{round_}-{policy}")
                runs[policy].append(run)
                print(f"round {round_} {policy}: hit rate {run['hit_rate']:.1%}, mean TTFT "
                      f"{run['mean_ttft_s'] * 1e3:.1f} ms, requests per pod {run['requests_per_pod']}, "
                      f"{run['errors']} errors, {run['seconds']:.1f} s", flush=True)
    pooled = {p: _pooled(runs[p]) for p in POLICIES}
    score, rr = pooled["score"], pooled["round_robin"]
    report = {
        "model": str(model),
        "dtype": args.dtype,
        "workload": {"requests": args.num_requests, "rate": args.rate, "seed": args.seed,
                     "system_prompts": args.system_prompts, "prompt_len": args.prompt_len,
                     "suffix_len": args.suffix_len, "output_len": args.output_len,
                     "max_concurrency": args.max_concurrency, "kv_prompts": args.kv_prompts},
        "kv_cache_bytes_per_pod": kv_bytes,
        "kv_blocks_per_pod": kv_blocks,
        "pooled": pooled,
        "ratios": {
            "hit_rate_score_over_rr": score["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf,
            "mean_ttft_rr_over_score": rr["mean_ttft_s"] / score["mean_ttft_s"],
        },
        "rounds": [{p: runs[p][i] for p in POLICIES} for i in range(args.rounds)],
    }
    _print_summary(report)
    write_report(report, args.output)
    return 0 if score["errors"] == 0 and rr["errors"] == 0 else 1


def add_parser(kinds) -> None:
    p = kinds.add_parser("routing", help="gateway routing: KV-aware scorer vs round robin")
    add_model_args(p, default_tiny=True)
    add_seed_arg(p)
    p.add_argument("--num-requests", type=positive_int, default=160)
    p.add_argument("--rate", type=positive_float, default=4.0,
                   help="mean arrivals per second (Poisson); 4/s keeps the tiny model's pods below saturation here")
    p.add_argument("--max-concurrency", type=non_negative_int, default=0, help="cap on requests in flight (0: none)")
    p.add_argument("--system-prompts", type=positive_int, default=8)
    p.add_argument("--prompt-len", type=positive_int, default=1024, help="tokens per system prompt")
    p.add_argument("--suffix-len", type=non_negative_int, default=32, help="tokens of each request's own suffix")
    p.add_argument("--output-len", type=positive_int, default=16)
    p.add_argument("--kv-prompts", type=positive_float, default=4.0,
                   help="each pod's KV cache, in requests' worth of tokens (prompt + suffix + output)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--pod-threads", type=positive_int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads per pod (--cpu-threads; default: half the cores each)")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="runs per policy (fresh pods each, order alternating)")
    add_logs_arg(p)
    add_output_arg(p, default="bench-results/routing.json")
    p.set_defaults(bench_func=main)
