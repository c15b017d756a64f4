"""``tessera bench throughput --peer vllm``: Tessera and vLLM's CPU build on the identical
request list and engine settings, in one command. Rounds alternate (Tessera, vLLM, Tessera,
...) so both sides meet the same noise of a shared machine; the figure is the ratio of the
two sides' median output tokens per second. Greedy outputs are compared request by request
on the first `--parity-requests`: in float32 they should agree exactly; in bfloat16 near-ties
may go either way, so the report says where each pair diverges."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

from engine_pod import LLM
from tessera_tools.bench.peers.vllm_peer import VLLMPeer, VLLMSettings
from tessera_tools.bench.workload import BenchRequest

# A generate of the whole request list may take this long on the peer before it counts as hung.
PEER_GENERATE_TIMEOUT_S = 3600.0


def parity(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Exact matches of greedy outputs, and for each pair that differs the first position where
    it does (None: they agree)."""
    first_diff = []
    for a, b in zip(ours, theirs):
        diverges = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diverges is None and len(a) != len(b):
            diverges = min(len(a), len(b))
        first_diff.append(diverges)
    return {"requests": len(first_diff), "exact_matches": sum(d is None for d in first_diff),
            "tokens_compared": sum(min(len(a), len(b)) for a, b in zip(ours, theirs)),
            "first_divergence": first_diff}


def comparison(tessera_tps: list[float], vllm_tps: list[float]) -> dict:
    ours, theirs = statistics.median(tessera_tps), statistics.median(vllm_tps)
    return {"tessera_tokens_per_second": tessera_tps, "vllm_tokens_per_second": vllm_tps,
            "tessera_median": ours, "vllm_median": theirs, "ratio_of_medians": ours / theirs}


def _dtype_name(llm: LLM) -> str:
    return str(llm.config.model.dtype).removeprefix("torch.")


def engine_settings(args: argparse.Namespace, llm: LLM, enable_prefix_caching: bool = False,
                    in_process: bool = False, log_stats: bool = False) -> VLLMSettings:
    """vLLM's settings from Tessera's loaded engine: its checkpoint, dtype, step budget and
    sequence limit, context length and KV cache size (whole GiB, as vLLM takes it)."""
    scheduler = llm.config.scheduler
    return VLLMSettings(
        model=str(llm.config.model.path), dtype=_dtype_name(llm), max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
        seed=args.seed, max_model_len=llm.config.model.max_model_len, kv_cache_gib=max(1, round(args.kv_cache_gib)),
        cpus=args.peer_cpus, in_process=in_process, log_stats=log_stats)


def profile_against_vllm(args: argparse.Namespace, llm: LLM, requests: list[BenchRequest], run_engine) -> dict:
    """One generate of each side under torch's profiler (--profile-ops --peer vllm): their
    operators by kind, side by side. vLLM's engine then runs in its worker's process."""
    from tessera_tools.bench.op_profile import describe, profile_ops, summarize

    ours = profile_ops(lambda: run_engine(llm, requests))
    with VLLMPeer(engine_settings(args, llm, in_process=True), log_path=args.peer_log) as peer:
        start = time.perf_counter()
        _, operators = peer.profile(requests, PEER_GENERATE_TIMEOUT_S)
        theirs = summarize(operators, time.perf_counter() - start)
        version = peer.version
    for name, figures in (("tessera", ours), (f"vllm {version}", theirs)):
        print(f"{name}:\n{describe(figures)}")
    return {"peer": {"name": "vllm", "version": version}, "operators": {"tessera": ours, "vllm": theirs}}


def run_against_vllm(args: argparse.Namespace, llm: LLM, requests: list[BenchRequest], run_engine) -> dict:
    """`run_engine(llm, requests)` -> (EngineRunResult, token ids): Tessera's side of a round."""
    settings = engine_settings(args, llm)
    expected = [r.output_len for r in requests]
    tessera_tps, vllm_tps = [], []
    first: dict[str, list[list[int]]] = {}
    with VLLMPeer(settings, log_path=args.peer_log) as peer:
        print(f"vLLM {peer.version} loaded ({settings.dtype}, KV cache {settings.kv_cache_gib} GiB, "
              f"OpenMP threads on cores {settings.cpus})")
        for round_index in range(args.rounds):
            result, ours = run_engine(llm, requests)
            theirs = peer.generate(requests, PEER_GENERATE_TIMEOUT_S)
            lengths = [len(t) for t in theirs.token_ids]
            if lengths != expected:
                raise RuntimeError(f"vLLM produced {sum(lengths)} tokens, expected {sum(expected)}")
            tessera_tps.append(result.tokens_per_second)
            vllm_tps.append(sum(lengths) / theirs.seconds)
            first.setdefault("tessera", ours)
            first.setdefault("vllm", theirs.token_ids)
            print(f"round {round_index + 1}/{args.rounds}: tessera {tessera_tps[-1]:.1f} tok/s, "
                  f"vllm {vllm_tps[-1]:.1f} tok/s")
        version = peer.version
    n = args.parity_requests
    report = {"peer": {"name": "vllm", "version": version, "settings": asdict(settings)},
              "rounds": comparison(tessera_tps, vllm_tps),
              "parity": parity(first["tessera"][:n], first["vllm"][:n])}
    c, p = report["rounds"], report["parity"]
    print(f"tessera / vllm (ratio of medians): {c['ratio_of_medians']:.2f}x "
          f"({c['tessera_median']:.1f} vs {c['vllm_median']:.1f} tok/s)")
    print(f"greedy parity on the first {p['requests']} requests: {p['exact_matches']} exact "
          f"({p['tokens_compared']} tokens compared)")
    return report
