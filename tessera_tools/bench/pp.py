"""``tessera bench pp``: pipeline parallelism against one stage, offline, on
the same greedy requests.

Each round builds the engine at --pipeline-parallel-size 1 and at the size
asked (worker processes, gloo on CPU), warms it up, runs one timed
`generate`, and reads every rank's stage figures (worker/stage_timing.py):
how long each stage computed and how long it waited for the others. The
bubble fraction is the share of the stages' time spent not computing. Rounds
alternate which side goes first, so drift in the machine's load favours
neither; ratios are of the medians.

The engine keeps one step per stage in flight, so the stages work on
different requests at once; on one machine PP still pays for the hand-offs
and the scheduling of more, smaller steps: it exists to fit a model that one
node cannot hold. The figures say what is left of the bubble and what it
costs."""

from __future__ import annotations

import argparse
import statistics

from engine_pod import LLM
from engine_pod.model.hf_config import load_arch_config
from engine_pod.worker.stage_timing import StageTiming, bubble_fraction, stage_leaders
from tessera_tools.bench.common import rotated, write_report
from tessera_tools.bench.flags import add_common_args, int_at_least, positive_float, positive_int
from tessera_tools.bench.throughput import EngineRunResult, generate_greedy
from tessera_tools.bench.workload import BenchRequest, sharegpt_like
from tessera.text.tokenizer import load_tokenizer


def _engine(args: argparse.Namespace, pp: int) -> LLM:
    return LLM(args.model, dtype=args.dtype, pipeline_parallel_size=pp, device="cpu",
               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
               kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), enable_prefix_caching=False)


def _one_run(args: argparse.Namespace, pp: int, requests: list[BenchRequest]) -> tuple[dict, list[list[int]]]:
    """One engine at `pp` stages: warmed up, then one timed generate and its stage figures."""
    with _engine(args, pp) as llm:
        generate_greedy(llm, requests[: min(4, len(requests))])  # warm-up: first-call costs
        executor = llm.engine_core.executor
        before: list[StageTiming] = executor.collective_rpc("stage_timing")
        result, tokens = generate_greedy(llm, requests)
        after: list[StageTiming] = executor.collective_rpc("stage_timing")
    stages = [a.since(b) for a, b in zip(after, before)]
    return _run_record(result, stages), tokens


def _run_record(result: EngineRunResult, stages: list[StageTiming]) -> dict:
    leaders = stage_leaders(stages)
    return {
        "seconds": result.seconds,
        "output_tokens": result.useful_tokens,
        "tokens_per_second": result.tokens_per_second,
        "steps": result.steps,
        "bubble_fraction": bubble_fraction(stages, result.seconds),
        "stages": [{"stage": t.stage, "step_ms": 1e3 * t.step_seconds / max(1, t.steps),
                    "busy_ms_per_step": 1e3 * t.busy_seconds / max(1, t.steps),
                    "wait_ms_per_step": 1e3 * t.wait_seconds / max(1, t.steps)} for t in leaders],
    }


def _summary(runs: list[dict]) -> dict:
    return {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            "bubble_fraction": statistics.median(r["bubble_fraction"] for r in runs)}


def main(args: argparse.Namespace) -> int:
    sizes = [1, args.pipeline_parallel_size]
    num_layers = load_arch_config(args.model).num_hidden_layers
    if args.pipeline_parallel_size > num_layers:
        print(f"--pipeline-parallel-size {args.pipeline_parallel_size} exceeds the model's {num_layers} layers")
        return 2
    requests = sharegpt_like(load_tokenizer(args.model), args.num_requests, args.max_prompt_len,
                             args.max_output_len, args.seed)
    runs: dict[int, list[dict]] = {pp: [] for pp in sizes}
    outputs: dict[int, list[list[int]]] = {}
    for r in range(args.rounds):
        for pp in rotated(sizes, r):
            record, tokens = _one_run(args, pp, requests)
            runs[pp].append(record)
            outputs.setdefault(pp, tokens)
            print(f"round {r + 1}, PP={pp}: {record['tokens_per_second']:.1f} output tok/s, "
                  f"bubble {record['bubble_fraction']:.1%}, "
                  + ", ".join(f"stage {s['stage']} busy {s['busy_ms_per_step']:.1f} / wait "
                              f"{s['wait_ms_per_step']:.1f} ms per step" for s in record["stages"]))
    one, many = _summary(runs[1]), _summary(runs[args.pipeline_parallel_size])
    same = sum(a == b for a, b in zip(outputs[1], outputs[args.pipeline_parallel_size]))
    report = {
        "settings": {k: v for k, v in vars(args).items() if not callable(v)},
        "runs": {f"pp{pp}": rs for pp, rs in runs.items()},
        "pp1": one, f"pp{args.pipeline_parallel_size}": many,
        "throughput_ratio": many["tokens_per_second"] / one["tokens_per_second"],
        "greedy_outputs_equal": f"{same}/{len(requests)}",
    }
    print(f"PP={args.pipeline_parallel_size} / PP=1 output tokens/s (medians of {args.rounds} rounds): "
          f"{report['throughput_ratio']:.2f}x; bubble {many['bubble_fraction']:.1%} vs "
          f"{one['bubble_fraction']:.1%}; greedy outputs equal in {report['greedy_outputs_equal']}")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("pp", help="offline: pipeline parallelism (worker processes, gloo) against one stage")
    add_common_args(p)
    p.add_argument("--pipeline-parallel-size", type=int_at_least(2), default=2, help="the stages to compare with 1")
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument("--max-prompt-len", type=positive_int, default=256)
    p.add_argument("--max-output-len", type=positive_int, default=64)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--kv-cache-gib", type=positive_float, default=1.0)
    p.add_argument("--rounds", type=positive_int, default=3, help="alternated rounds of each side")
    p.set_defaults(bench_func=main)
