"""``tessera bench throughput``: offline throughput of Tessera vs HF static batching, or vs
vLLM's CPU build (``--peer vllm``, peer_throughput.py)."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

from engine_pod import LLM, SamplingParams
from tessera_tools.bench.common import write_report
from tessera_tools.bench.flags import (add_common_args, add_device_arg, add_offline_peer_args, positive_float,
                                       positive_int)
from tessera_tools.bench.kernel_ablation import ABLATIONS
from tessera_tools.bench.workload import BenchRequest, sharegpt_like


@dataclass
class EngineRunResult:
    seconds: float
    useful_tokens: int
    forward_seconds: float
    steps: int
    preemptions: int

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.seconds

    @property
    def share_outside_forward(self) -> float:
        return 1.0 - self.forward_seconds / self.seconds


def run_engine(llm: LLM, requests: list[BenchRequest]) -> EngineRunResult:
    return generate_greedy(llm, requests)[0]


def generate_greedy(llm: LLM, requests: list[BenchRequest]) -> tuple[EngineRunResult, list[list[int]]]:
    """One timed `generate` of the requests (greedy, ignore_eos: every output its exact length),
    with each request's output token ids."""
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    executor = llm.engine_core.executor
    forward_before, steps_before = executor.forward_seconds, llm.stats.steps
    preempt_before = llm.stats.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    useful = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r.output_len for r in requests)
    if useful != expected:
        raise RuntimeError(f"engine produced {useful} tokens, expected {expected}")
    result = EngineRunResult(
        seconds, useful, executor.forward_seconds - forward_before,
        llm.stats.steps - steps_before, llm.stats.num_preemptions - preempt_before,
    )
    return result, [list(o.outputs[0].token_ids) for o in outputs]


def _workload_record(requests: list[BenchRequest]) -> dict:
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "max_prompt_len": max(len(r.prompt_token_ids) for r in requests),
        "max_output_len": max(r.output_len for r in requests),
    }


def _other_run(args: argparse.Namespace, llm: LLM, requests: list[BenchRequest]) -> dict | None:
    """--peer vllm, --profile-ops, --step-breakdown or --ablate: their part of the report; None for the
    comparison with HF."""
    if args.ablate:
        from tessera_tools.bench.kernel_ablation import ablate

        return ablate(llm, requests, args.ablate, args.rounds, generate_greedy)
    if args.peer == "vllm":
        from tessera_tools.bench.peer_throughput import profile_against_vllm, run_against_vllm

        run = profile_against_vllm if args.profile_ops else run_against_vllm
        return run(args, llm, requests, generate_greedy)
    if args.step_breakdown:
        return _step_breakdown(llm, requests)
    if args.profile_ops:
        from tessera_tools.bench.op_profile import describe, profile_ops

        ops = profile_ops(lambda: run_engine(llm, requests))
        print(f"where the time went, one generate under torch's profiler ({llm.config.model.dtype}):")
        print(describe(ops))
        return {"operators": ops}
    return None


def _step_breakdown(llm: LLM, requests: list[BenchRequest]) -> dict:
    from tessera_tools.bench.profile import StepRecorder
    from tessera_tools.bench.step_breakdown import as_report, describe, summarise

    recorder = StepRecorder()
    llm.engine_core.step_observer, recorder.recording = recorder, True
    try:
        engine = run_engine(llm, requests)
    finally:
        llm.engine_core.step_observer = None
    groups = summarise(recorder.samples)
    print(f"one generate ({llm.config.model.dtype}): {engine.useful_tokens} tokens in {engine.seconds:.1f} s, "
          f"{engine.steps} steps, by kind of step:")
    print(describe(groups))
    return {"tessera": _engine_record(engine), "steps": as_report(groups)}


def _engine_record(engine: EngineRunResult) -> dict:
    return {**asdict(engine), "tokens_per_second": engine.tokens_per_second,
            "share_outside_forward": engine.share_outside_forward}


def _warm_up(llm: LLM) -> None:
    llm.generate([{"prompt_token_ids": [5] * 64}] * 4, SamplingParams(temperature=0.0, max_tokens=4))


def main(args: argparse.Namespace) -> int:
    if args.peer and (args.step_breakdown or args.ablate):
        print("--peer runs with --profile-ops or on its own, not with --step-breakdown or --ablate")
        return 2
    llm = LLM(
        args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), enable_prefix_caching=False,
        device=args.device,
    )
    tokenizer = llm.get_tokenizer()
    requests = sharegpt_like(tokenizer, args.num_requests, args.max_prompt_len, args.max_output_len, args.seed)
    _warm_up(llm)
    other = _other_run(args, llm, requests)
    if other is not None:
        write_report({"workload": _workload_record(requests), "dtype": str(llm.config.model.dtype), **other},
                     args.output)
        return 0
    engine = run_engine(llm, requests)
    report = {
        "workload": _workload_record(requests),
        "tessera": _engine_record(engine),
    }
    print(f"dtype {llm.config.model.dtype}, device {llm.config.device}")
    print(f"tessera: {engine.useful_tokens} tokens in {engine.seconds:.1f}s = {engine.tokens_per_second:.1f} tok/s; "
          f"{engine.share_outside_forward:.1%} of wall time outside the forward; {engine.steps} steps")
    if not args.skip_hf:
        from tessera_tools.bench.hf_baseline import run_hf_in_fresh_process

        llm_dtype, device = llm.config.model.dtype, llm.config.device
        del llm  # free the engine's KV cache before HF runs
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        hf = run_hf_in_fresh_process(args.model, requests, pad, args.hf_batch_size, llm_dtype, str(device))
        hf_tps = hf.useful_tokens / hf.seconds
        report["hf"] = {**asdict(hf), "tokens_per_second": hf_tps, "batch_size": args.hf_batch_size}
        report["dtype"] = str(llm_dtype)
        report["speedup"] = engine.tokens_per_second / hf_tps
        print(f"hf static batches of {args.hf_batch_size}: {hf.useful_tokens} useful tokens in {hf.seconds:.1f}s "
              f"= {hf_tps:.1f} tok/s; Tessera / HF = {report['speedup']:.1f}x")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("throughput", help="offline throughput: Tessera vs HF static batching, or vs vLLM")
    add_common_args(p)
    p.add_argument("--num-requests", type=positive_int, default=128)
    p.add_argument("--max-prompt-len", type=positive_int, default=512)
    p.add_argument("--max-output-len", type=positive_int, default=256)
    add_device_arg(p)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--kv-cache-gib", type=positive_float, default=4.0)
    p.add_argument("--hf-batch-size", type=positive_int, default=32)
    p.add_argument("--skip-hf", action="store_true", help="run Tessera only")
    instead = p.add_mutually_exclusive_group()
    instead.add_argument("--profile-ops", action="store_true",
                         help="instead: one generate under torch's profiler, its time by kind of operator "
                              "(op_profile.py; with --peer vllm, both engines)")
    instead.add_argument("--step-breakdown", action="store_true",
                         help="instead: one generate, its engine steps grouped by kind with their time "
                              "(step_breakdown.py; Tessera only)")
    instead.add_argument("--ablate", choices=ABLATIONS, default=None,
                         help="instead: this CPU kernel off and on in alternated --rounds of one engine "
                              "(kernel_ablation.py)")
    peer = p.add_argument_group("peer, instead of HF (docs/benchmarks.md)")
    add_offline_peer_args(peer)
    peer.add_argument("--rounds", type=positive_int, default=3,
                      help="alternated rounds of each side (--peer, --ablate)")
    peer.add_argument("--parity-requests", type=positive_int, default=20,
                      help="greedy outputs compared with the peer's on this many first requests")
    p.set_defaults(bench_func=main)
