"""``tessera bench prefix-cache --peer vllm``: Tessera and vLLM's CPU build, both with prefix
caching on, on the same two workloads: requests that share one long prefix (mean TTFT,
throughput, prompt tokens served from cache) and requests that share none (what caching costs
each engine where it cannot help). Every round draws fresh text, so neither side hits what an
earlier round cached; which side goes first alternates. Figures are medians over rounds, and
the ratios Tessera over vLLM (throughput) and vLLM over Tessera (TTFT: above 1, Tessera's is
lower). Greedy outputs of the first round's shared-prefix requests are compared, KV served
from each side's cache included."""

from __future__ import annotations

import argparse
import statistics

from engine_pod import LLM
from tessera_tools.bench.common import rotated
from tessera_tools.bench.peer_throughput import PEER_GENERATE_TIMEOUT_S, engine_settings, parity
from tessera_tools.bench.peers.vllm_peer import PeerRun, VLLMPeer
from tessera_tools.bench.workload import BenchRequest, shared_prefix, sharegpt_like

SIDES = ("tessera", "vllm")
WORKLOADS = ("shared_prefix", "no_shared_prefix")


def vllm_figures(run: PeerRun, requests: list[BenchRequest]) -> dict:
    """The figures Tessera's side reports (prefix_cache.run), from vLLM's answer; its outputs
    must have their exact lengths (greedy, ignore_eos) or the round does not count."""
    lengths = [len(t) for t in run.token_ids]
    if lengths != [r.output_len for r in requests]:
        raise RuntimeError(f"vLLM produced {sum(lengths)} tokens, expected {sum(r.output_len for r in requests)}")
    ttfts = run.ttft_s
    if len(ttfts) != len(requests) or any(t is None for t in ttfts):
        raise RuntimeError("vLLM reported no TTFT per request (its stats are off: settings.log_stats)")
    return {"seconds": run.seconds, "tokens_per_second": sum(lengths) / run.seconds,
            "mean_ttft_s": statistics.mean(ttfts), "cached_prompt_tokens": sum(run.cached_tokens)}


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Per side the medians over rounds; the throughput ratio Tessera / vLLM and the TTFT ratio
    vLLM / Tessera (both above 1 where Tessera is ahead)."""
    medians = {side: {key: statistics.median(r[key] for r in rounds[side])
                      for key in ("tokens_per_second", "mean_ttft_s", "cached_prompt_tokens")} for side in SIDES}
    ours, theirs = medians["tessera"], medians["vllm"]
    return {"rounds": rounds, "medians": medians,
            "throughput_ratio_tessera_over_vllm": ours["tokens_per_second"] / theirs["tokens_per_second"],
            "mean_ttft_ratio_vllm_over_tessera": theirs["mean_ttft_s"] / ours["mean_ttft_s"]}


def _workloads(args: argparse.Namespace, tokenizer, round_index: int) -> dict[str, list[BenchRequest]]:
    """Fresh text each round (the seed moves), so no round hits an earlier one's prefix."""
    return {"shared_prefix": shared_prefix(tokenizer, args.num_requests, args.prefix_len, args.suffix_len,
                                           args.output_len, seed=args.seed + round_index),
            "no_shared_prefix": sharegpt_like(tokenizer, args.unique_requests, 512, 128, seed=1000 + round_index)}


def run_against_vllm(args: argparse.Namespace, llm: LLM, run_engine) -> dict:
    """`llm`: Tessera's engine with prefix caching on; `run_engine(llm, requests)` -> (figures,
    token ids) is Tessera's side of a round."""
    settings = engine_settings(args, llm, enable_prefix_caching=True, log_stats=True)
    tokenizer = llm.get_tokenizer()
    rounds = {w: {side: [] for side in SIDES} for w in WORKLOADS}
    first: dict[str, list[list[int]]] = {}
    with VLLMPeer(settings, log_path=args.peer_log) as peer:
        print(f"vLLM {peer.version} loaded ({settings.dtype}, prefix caching on both sides)")
        for r in range(args.rounds):
            for name, requests in _workloads(args, tokenizer, r).items():
                for side in rotated(SIDES, r):
                    if side == "tessera":
                        figures, token_ids = run_engine(llm, requests)
                    else:
                        run = peer.generate(requests, PEER_GENERATE_TIMEOUT_S)
                        figures, token_ids = vllm_figures(run, requests), run.token_ids
                    rounds[name][side].append(figures)
                    if name == "shared_prefix":
                        first.setdefault(side, token_ids)
            print(f"round {r + 1}/{args.rounds}: " + "; ".join(
                f"{w} tessera {rounds[w]['tessera'][-1]['tokens_per_second']:.1f} vs vllm "
                f"{rounds[w]['vllm'][-1]['tokens_per_second']:.1f} tok/s" for w in WORKLOADS))
        version = peer.version
    report = {"peer": {"name": "vllm", "version": version}, **{w: summarize(rounds[w]) for w in WORKLOADS},
              "parity_shared_prefix": parity(first["tessera"], first["vllm"])}
    shared, unique, same = report["shared_prefix"], report["no_shared_prefix"], report["parity_shared_prefix"]
    m = shared["medians"]
    print(f"shared {args.prefix_len}-token prefix: mean TTFT tessera {m['tessera']['mean_ttft_s']:.2f} s vs vllm "
          f"{m['vllm']['mean_ttft_s']:.2f} s ({shared['mean_ttft_ratio_vllm_over_tessera']:.2f}x); throughput "
          f"tessera / vllm {shared['throughput_ratio_tessera_over_vllm']:.2f}x; prompt tokens from cache "
          f"{m['tessera']['cached_prompt_tokens']:.0f} vs {m['vllm']['cached_prompt_tokens']:.0f}")
    print(f"no shared prefix: throughput tessera / vllm {unique['throughput_ratio_tessera_over_vllm']:.2f}x")
    print(f"greedy outputs equal on the first round's shared-prefix requests: {same['exact_matches']} of "
          f"{same['requests']}")
    return report
