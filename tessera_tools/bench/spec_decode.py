"""``tessera bench spec``: n-gram speculative decoding on vs off.

One engine without speculation and one per draft length k, on the same
copy-heavy workload, side by side in one run: each request alone (latency,
where a decode step is bound by reading the weights) and all of them as one
batch. Rounds alternate the engines (rotating which goes first) so drift in
the machine's load spreads over all of them; per-round ratios against the
engine without speculation are what to read. Greedy, so every engine emits
the same tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine_pod import LLM, SamplingParams
from tessera_tools.bench.common import rotated, write_report
from tessera_tools.bench.flags import add_common_args, add_threads_arg, positive_int, positive_int_list
from tessera_tools.bench.workload import BenchRequest, copy_heavy


def _params(requests: list[BenchRequest]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]


def _prompts(requests: list[BenchRequest]) -> list[dict]:
    return [{"prompt_token_ids": r.prompt_token_ids} for r in requests]


def _counters(llm: LLM) -> tuple[int, int, int, int]:
    s = llm.stats
    return s.steps, s.spec_decode.num_drafts, s.spec_decode.num_draft_tokens, s.spec_decode.num_accepted_tokens


def _run_once(llm: LLM, requests: list[BenchRequest], one_at_a_time: bool) -> dict:
    before = _counters(llm)
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate(p, s)[0] for p, s in zip(_prompts(requests), _params(requests))]
    else:
        outputs = llm.generate(_prompts(requests), _params(requests))
    seconds = time.perf_counter() - start
    steps, drafts, draft_tokens, accepted = (a - b for a, b in zip(_counters(llm), before))
    return {
        "seconds": seconds,
        "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "mean_latency_s": statistics.mean(o.metrics["finished_time"] - o.metrics["arrival_time"] for o in outputs),
        "steps": steps, "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def _summarise(runs: list[dict], base_runs: list[dict]) -> dict:
    seconds, tokens, steps = (sum(r[key] for r in runs) for key in ("seconds", "tokens", "steps"))
    drafts, draft_tokens, accepted = (sum(r[key] for r in runs) for key in ("drafts", "draft_tokens", "accepted"))
    return {
        "tokens_per_second": tokens / seconds,
        "mean_latency_s": statistics.median(r["mean_latency_s"] for r in runs),
        "speedup_per_round": [b["seconds"] / r["seconds"] for r, b in zip(runs, base_runs)],
        "latency_ratio_per_round": [b["mean_latency_s"] / r["mean_latency_s"] for r, b in zip(runs, base_runs)],
        "steps": steps,
        "ms_per_step": 1e3 * seconds / steps,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else 1.0,
    }


def main(args: argparse.Namespace) -> int:
    if args.threads:
        # On a shared machine a multi-threaded small GEMM (the verification
        # forward's k + 1 rows) stalls in OpenMP barriers whenever another
        # process holds a core, while the one-row decode GEMV does not.
        torch.set_num_threads(args.threads)
    ks = [0, *args.k]
    llms = {
        k: LLM(args.model, dtype=args.dtype, device="cpu", kv_cache_memory_bytes=args.kv_cache_mib << 20,
               speculative_config=None if k == 0 else {
                   "method": "ngram", "num_speculative_tokens": k,
                   "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max})
        for k in ks
    }
    tokenizer = llms[0].get_tokenizer()
    warm_up = copy_heavy(tokenizer, 1, 16, 2, 8, seed=args.seed + 100)
    for llm in llms.values():
        llm.generate(_prompts(warm_up), _params(warm_up))
    report: dict = {"k": ks[1:], "rounds": args.rounds, "threads": torch.get_num_threads()}
    for name, alone in (("one_at_a_time", True), ("batch", False)):
        runs: dict[int, list[dict]] = {k: [] for k in ks}
        for r in range(args.rounds):
            # Fresh text each round, so no engine replays what it cached.
            requests = copy_heavy(tokenizer, args.num_requests, args.passage_len, args.repeats, args.output_len,
                                  seed=args.seed + 10 * r + alone)
            for k in rotated(ks, r):
                runs[k].append(_run_once(llms[k], requests, alone))
            if any(runs[k][-1]["token_ids"] != runs[0][-1]["token_ids"] for k in ks):
                raise RuntimeError(f"{name}: speculation changed the greedy tokens")
        report[name] = {("off" if k == 0 else f"k={k}"): _summarise(runs[k], runs[0]) for k in ks}
        print(f"{name}: {args.num_requests} requests of {args.passage_len} x {args.repeats} prompt tokens, "
              f"{args.output_len} out, {args.rounds} alternating rounds")
        for label, s in report[name].items():
            speedup = statistics.median(s["speedup_per_round"])
            print(f"  {label:>5}: {s['tokens_per_second']:6.1f} tok/s, median speedup {speedup:.2f}x, "
                  f"mean latency {s['mean_latency_s']:.2f}s, {s['steps']} steps of {s['ms_per_step']:.1f} ms, "
                  f"acceptance {s['acceptance_rate']:.0%}, mean accepted length {s['mean_accepted_length']:.2f}")
    for llm in llms.values():
        llm.shutdown()
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("spec", help="n-gram speculative decoding on vs off")
    add_common_args(p)
    p.add_argument("--k", type=positive_int_list, default="2,4,6", help="draft lengths to compare, comma-separated")
    p.add_argument("--lookup-min", type=positive_int, default=2)
    p.add_argument("--lookup-max", type=positive_int, default=4)
    p.add_argument("--num-requests", type=positive_int, default=2)
    p.add_argument("--passage-len", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3, help="copies of the passage in each prompt")
    p.add_argument("--output-len", type=positive_int, default=48)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--kv-cache-mib", type=positive_int, default=256)
    add_threads_arg(p)
    p.set_defaults(bench_func=main)
