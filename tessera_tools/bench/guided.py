"""``tessera bench guided``: offline throughput of guided decoding (JSON
schemas) vs unguided decoding of the same requests, side by side in one run.

The guided run goes first; each unguided request then generates exactly as
many tokens as its guided twin did (ignore_eos, max_tokens = that length),
so both runs compute the same tokens and differ only by the grammar work:
compiles (cached here: warmed before timing), the per-step bitmask fill on
the engine thread, the mask on the logits, and the matcher advancing.
Runs alternate (guided, unguided, guided, ...); each is timed in wall-clock
seconds and in this process's CPU seconds. On a shared machine the CPU time
(with --threads 1, no spinning thread team) moves far less with other
load than the wall time; the report quotes both, median and best.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine_pod import LLM, SamplingParams
from engine_pod.structured_output import StructuredOutputsParams
from tessera_tools.bench.common import write_report
from tessera_tools.bench.flags import add_common_args, add_device_arg, add_threads_arg, positive_float, positive_int
from tessera_tools.bench.guided_workload import PROMPTS, SCHEMAS


def _guided_params(args: argparse.Namespace) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
        for i in range(args.num_requests)
    ]


def _timed(llm: LLM, prompts: list[str], params: list[SamplingParams]
           ) -> tuple[tuple[float, float], list[list[int]], list[str]]:
    """((wall seconds, CPU seconds), output token ids, finish reasons)."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    seconds = (time.perf_counter() - wall, time.process_time() - cpu)
    return seconds, [o.outputs[0].token_ids for o in outputs], [o.outputs[0].finish_reason for o in outputs]


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
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
    runs: dict[str, list[tuple[float, float]]] = {"guided": [], "unguided": []}
    for _ in range(args.repeats):
        seconds, again, _ = _timed(llm, prompts, guided)
        if again != token_ids:
            raise RuntimeError("guided greedy outputs changed between runs")
        runs["guided"].append(seconds)
        seconds, plain, _ = _timed(llm, prompts, unguided)
        if sum(len(ids) for ids in plain) != num_tokens:
            raise RuntimeError("the unguided run produced a different number of tokens")
        runs["unguided"].append(seconds)
    summary = {}
    for clock, index in (("wall", 0), ("cpu", 1)):
        for stat, pick in (("median", statistics.median), ("best", min)):
            seconds = {kind: pick(r[index] for r in values) for kind, values in runs.items()}
            # Same tokens both sides: the throughput ratio is the inverse time ratio.
            summary[f"{clock}_{stat}"] = {**{f"{k}_seconds": v for k, v in seconds.items()},
                                          "guided_over_unguided": seconds["unguided"] / seconds["guided"]}
    report = {
        "model": str(llm.config.model.path), "dtype": str(llm.config.model.dtype), "device": str(llm.config.device),
        "torch_threads": torch.get_num_threads(), "num_requests": args.num_requests, "num_schemas": len(SCHEMAS),
        "output_tokens": num_tokens, "finished_by_grammar": sum(r == "stop" for r in reasons),
        "runs_wall_cpu_seconds": runs, "summary": summary, "compile_seconds_all_schemas": compile_seconds,
        "compiles": manager.stats.num_compiles, "compile_cache_hits": manager.stats.num_cache_hits,
    }
    print(f"{llm.config.model.path} {llm.config.model.dtype} on {llm.config.device}, {torch.get_num_threads()} "
          f"threads: {args.num_requests} requests, {num_tokens} output tokens each way "
          f"({report['finished_by_grammar']} guided ones ended by their grammar)")
    for kind in ("unguided", "guided"):
        print(f"{kind:>9} runs (wall s / CPU s): " + ", ".join(f"{w:.2f}/{c:.2f}" for w, c in runs[kind]))
    for name, row in summary.items():
        print(f"{name:>11}: unguided {row['unguided_seconds']:.2f}s ({num_tokens / row['unguided_seconds']:.1f} tok/s)"
              f", guided {row['guided_seconds']:.2f}s ({num_tokens / row['guided_seconds']:.1f} tok/s); "
              f"guided/unguided throughput {row['guided_over_unguided']:.3f}")
    print(f"compiling {len(SCHEMAS)} schemas took {compile_seconds:.3f}s; "
          f"{manager.stats.num_compiles} compiles, {manager.stats.num_cache_hits} cache hits in all")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("guided", help="guided decoding (JSON schemas) vs unguided, same requests and tokens")
    add_common_args(p)
    add_device_arg(p)
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=5)
    add_threads_arg(p)
    p.add_argument("--kv-cache-gib", type=positive_float, default=1.0)
    p.set_defaults(bench_func=main)
