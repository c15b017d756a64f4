"""``tessera bench tp-memory``: each rank's resident weights at TP=1 vs TP=N.

Both sizes run their ranks as worker processes (TP=1 through a one-rank
MultiProcExecutor), so every figure is a fresh process's own: parameter
bytes held, and the resident set (current and peak) after loading, with a
small fixed KV cache. The parameter ratio is the acceptance figure (at most
55% at TP=2); the peak RSS shows no rank ever held the whole model.
"""

from __future__ import annotations

import argparse

from engine_pod.config import create_engine_config
from engine_pod.executor.multiproc import MultiProcExecutor
from tessera_tools.bench.common import write_report
from tessera_tools.bench.flags import add_model_args, add_output_arg, positive_int


def _per_rank(args: argparse.Namespace, tp: int) -> list[dict]:
    config = create_engine_config(args.model, dtype=args.dtype, device="cpu", max_model_len=256,
                                  tensor_parallel_size=tp, worker_threads=1)
    executor = MultiProcExecutor(config, world_size=tp)
    try:
        executor.initialize_kv_cache(args.kv_blocks)
        weights = executor.collective_rpc("weight_bytes")
        memory = executor.collective_rpc("resident_memory")
    finally:
        executor.shutdown()
    return [{"weight_bytes": w, **m} for w, m in zip(weights, memory)]


def main(args: argparse.Namespace) -> int:
    report = {"model": args.model, "tp1": _per_rank(args, 1), f"tp{args.tp}": _per_rank(args, args.tp)}
    base, split = report["tp1"][0], report[f"tp{args.tp}"]
    ratio = max(r["weight_bytes"] for r in split) / base["weight_bytes"]
    report["weight_ratio_max_rank"] = ratio
    mib = 2**20
    weights = ", ".join(f"{r['weight_bytes'] / mib:.1f}" for r in split)
    peaks = ", ".join(f"{r.get('peak_rss_bytes', 0) / mib:.0f}" for r in split)
    print(f"weights per rank: TP=1 {base['weight_bytes'] / mib:.1f} MiB, TP={args.tp} {weights} MiB "
          f"({ratio:.1%} of TP=1); peak RSS per rank: TP=1 {base.get('peak_rss_bytes', 0) / mib:.0f} MiB, "
          f"TP={args.tp} {peaks} MiB")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("tp-memory", help="per-rank weight memory at TP=1 vs TP=N (CPU)")
    add_model_args(p)
    p.add_argument("--tp", type=positive_int, default=2)
    p.add_argument("--kv-blocks", type=positive_int, default=64)
    add_output_arg(p)
    p.set_defaults(bench_func=main)
