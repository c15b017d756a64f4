"""``tessera bench prefix-cache``: prefix caching on vs off.

Two workloads: requests sharing one long prefix (TTFT and throughput, on vs
off), and requests with no shared prefix (the overhead of caching when it
cannot help), each run alternately on and off to spread the machine's noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_pod import LLM, SamplingParams
from kv_store.block_hash import hash_request_tokens
from tessera_tools.bench.common import rotated, write_report
from tessera_tools.bench.flags import (add_common_args, add_device_arg, add_offline_peer_args, non_negative_int,
                                       positive_float, positive_int)
from tessera_tools.bench.workload import BenchRequest, shared_prefix, sharegpt_like


def run_with_outputs(llm: LLM, requests: list[BenchRequest]) -> tuple[dict, list[list[int]]]:
    """One timed greedy `generate` of the requests: its figures, and each request's output token ids."""
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params)
    seconds = time.perf_counter() - start
    ttfts = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    figures = {
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "mean_ttft_s": statistics.mean(ttfts),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
    }
    return figures, [list(o.outputs[0].token_ids) for o in outputs]


def _run(llm: LLM, requests: list[BenchRequest]) -> dict:
    return run_with_outputs(llm, requests)[0]


def _engine(args: argparse.Namespace, caching: bool) -> LLM:
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), device=args.device)
    llm.generate([{"prompt_token_ids": [5] * 64}] * 4, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    return llm


def caching_cpu_seconds(requests: list[BenchRequest], block_size: int) -> float:
    """CPU time of what prefix caching adds per request, replayed outside the
    engine: hashing every full block of prompt and output, and one lookup per
    prompt block. A low-noise companion to the on/off throughput ratio."""
    start = time.perf_counter()
    cache: dict[bytes, int] = {}
    for r in requests:
        tokens = r.prompt_token_ids + [7] * r.output_len
        hashes = hash_request_tokens(tokens, block_size)
        for h in hashes[: len(r.prompt_token_ids) // block_size]:
            cache.get(h)
        cache.update((h, 0) for h in hashes)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    if args.peer == "vllm":
        from tessera_tools.bench.peer_prefix_cache import run_against_vllm

        write_report(run_against_vllm(args, _engine(args, True), run_with_outputs), args.output)
        return 0
    engines = {on: _engine(args, on) for on in (True, False)}
    tokenizer = engines[True].get_tokenizer()
    shared = shared_prefix(tokenizer, args.num_requests, args.prefix_len, args.suffix_len, args.output_len, args.seed)
    report: dict = {"shared_prefix": {}, "no_shared_prefix": {}}
    for on, llm in engines.items():
        report["shared_prefix"]["on" if on else "off"] = _run(llm, shared)
    on, off = report["shared_prefix"]["on"], report["shared_prefix"]["off"]
    report["shared_prefix"]["ttft_ratio_off_over_on"] = off["mean_ttft_s"] / on["mean_ttft_s"]
    report["shared_prefix"]["throughput_ratio_on_over_off"] = on["tokens_per_second"] / off["tokens_per_second"]
    print(f"shared {args.prefix_len}-token prefix, {args.num_requests} requests: mean TTFT on {on['mean_ttft_s']:.2f}s "
          f"vs off {off['mean_ttft_s']:.2f}s ({report['shared_prefix']['ttft_ratio_off_over_on']:.1f}x lower); "
          f"throughput {on['tokens_per_second']:.1f} vs {off['tokens_per_second']:.1f} tok/s")

    # No shared prefixes: every run on fresh text (distinct seeds), so the
    # "on" engine cannot hit what an earlier round cached.
    ratios, direct = [], []
    for r in range(args.rounds):
        unique = sharegpt_like(tokenizer, args.unique_requests, 512, 128, seed=1000 + r)
        results = {key: _run(engines[on], unique) for key, on in rotated((("on", True), ("off", False)), r)}
        ratios.append(results["on"]["tokens_per_second"] / results["off"]["tokens_per_second"])
        direct.append(caching_cpu_seconds(unique, engines[True].config.cache.block_size) / results["off"]["seconds"])
        report["no_shared_prefix"][f"round_{r}"] = results
    median = statistics.median(ratios)
    report["no_shared_prefix"]["throughput_ratios_on_over_off"] = ratios
    report["no_shared_prefix"]["median_overhead"] = 1.0 - median
    report["no_shared_prefix"]["hashing_and_lookup_share_of_run"] = direct
    print(f"no shared prefix, {args.rounds} alternating rounds: throughput on/off ratios "
          f"{', '.join(f'{x:.3f}' for x in ratios)}; median overhead {1.0 - median:.1%}; "
          f"hashing + lookups replayed: {statistics.median(direct):.3%} of a run's wall time")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("prefix-cache", help="prefix caching on vs off")
    add_common_args(p)
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--prefix-len", type=positive_int, default=1024)
    p.add_argument("--suffix-len", type=non_negative_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=32)
    p.add_argument("--unique-requests", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=7,
                   help="alternating on/off rounds without a shared prefix (--peer: rounds of both workloads)")
    add_device_arg(p)
    p.add_argument("--kv-cache-gib", type=positive_float, default=4.0)
    add_offline_peer_args(p.add_argument_group("peer, instead of on vs off: both engines with caching on "
                                               "(peer_prefix_cache.py)"))
    p.set_defaults(bench_func=main)
