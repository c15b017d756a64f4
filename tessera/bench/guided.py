"""``tessera bench guided``: offline throughput of guided decoding (JSON
schemas) vs unguided decoding of the same requests, side by side in one run.

The guided run goes first; each unguided request then generates exactly as
many tokens as its guided twin did (ignore_eos, max_tokens = that length),
so both runs compute the same tokens and differ only by the grammar work:
compiles (cached here: warmed before timing), the per-step bitmask fill on
the engine thread, the mask on the logits, and the matcher advancing.
Runs alternate (guided, unguided, guided, ...) and the median of each is kept.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_pod import LLM, SamplingParams
from engine_pod.structured_output import StructuredOutputsParams
from tessera.bench.common import add_common_args, write_report
from tessera.bench.guided_workload import PROMPTS, SCHEMAS


def _guided_params(args: argparse.Namespace) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
        for i in range(args.num_requests)
    ]


def _timed(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[list[int]], list[str]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, [o.outputs[0].token_ids for o in outputs], [o.outputs[0].finish_reason for o in outputs]


def main(args: argparse.Namespace) -> int:
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.num_requests,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), enable_prefix_caching=False)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
    guided = _guided_params(args)
    manager = llm.engine_core.structured_output
    # Warm-up: compiles every schema (then cached) and the first-call costs.
    _timed(llm, prompts[: len(SCHEMAS)], guided[: len(SCHEMAS)])
    compile_seconds = manager.stats.compile_seconds
    _, token_ids, reasons = _timed(llm, prompts, guided)
    unguided = [SamplingParams(temperature=0.0, max_tokens=len(ids), ignore_eos=True) for ids in token_ids]
    num_tokens = sum(len(ids) for ids in token_ids)
    times: dict[str, list[float]] = {"guided": [], "unguided": []}
    for _ in range(args.repeats):
        seconds, again, _ = _timed(llm, prompts, guided)
        if again != token_ids:
            raise RuntimeError("guided greedy outputs changed between runs")
        times["guided"].append(seconds)
        seconds, plain, _ = _timed(llm, prompts, unguided)
        if sum(len(ids) for ids in plain) != num_tokens:
            raise RuntimeError("the unguided run produced a different number of tokens")
        times["unguided"].append(seconds)
    median = {kind: statistics.median(values) for kind, values in times.items()}
    tps = {kind: num_tokens / seconds for kind, seconds in median.items()}
    ratio = tps["guided"] / tps["unguided"]
    report = {
        "model": str(llm.config.model.path), "dtype": str(llm.config.model.dtype), "device": str(llm.config.device),
        "num_requests": args.num_requests, "num_schemas": len(SCHEMAS), "output_tokens": num_tokens,
        "finished_by_grammar": sum(r == "stop" for r in reasons),
        "seconds": times, "median_seconds": median, "tokens_per_second": tps,
        "guided_over_unguided": ratio, "compile_seconds_all_schemas": compile_seconds,
        "compiles": manager.stats.num_compiles, "compile_cache_hits": manager.stats.num_cache_hits,
    }
    print(f"{llm.config.model.path} {llm.config.model.dtype} on {llm.config.device}: {args.num_requests} requests, "
          f"{num_tokens} output tokens ({report['finished_by_grammar']} ended by their grammar)")
    for kind in ("unguided", "guided"):
        print(f"{kind:>9}: median {median[kind]:.2f}s = {tps[kind]:.1f} tok/s  (runs: "
              + ", ".join(f"{s:.2f}" for s in times[kind]) + ")")
    print(f"guided / unguided throughput = {ratio:.3f} ({1 - ratio:+.1%} lower); "
          f"compiling {len(SCHEMAS)} schemas took {compile_seconds:.3f}s, "
          f"{manager.stats.num_compiles} compiles, {manager.stats.num_cache_hits} cache hits")
    if args.output:
        write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("guided", help="guided decoding (JSON schemas) vs unguided, same requests and tokens")
    add_common_args(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.set_defaults(bench_func=main)
