"""``tessera bench lora``: a batch mixing LoRA adapters against the base model alone.

One engine started with enable_lora runs the throughput benchmark's request
list twice per round: every request on the base model, then request i on
adapter i mod N (all N resident in the model's slots, so each step mixes
them). Rounds alternate which goes first; the figure is the ratio of the
medians. The adapters are random PEFT adapters written for the checkpoint
(``tessera make-model --lora-for``), kept beside it.

Then the cold start of an adapter: a short request on an adapter never seen
(its files read off the step loop, then written into a slot), against the
same request on a resident one, and the read alone (the loader's timer).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from engine_pod import LLM, LoRARequest, SamplingParams
from tessera_tools.bench.common import rotated, write_report
from tessera_tools.bench.flags import add_common_args, add_device_arg, positive_float, positive_int
from tessera_tools.bench.throughput import EngineRunResult
from tessera_tools.bench.workload import BenchRequest, sharegpt_like
from tessera_tools.fixtures.make_lora import make_lora_adapter

# One extra adapter, never used before the cold-start measurement.
_COLD = 1


def adapters_for(model: Path, count: int, rank: int, folder: Path | None) -> list[Path]:
    """``count`` adapters of ``rank`` for ``model`` (written once; deterministic)."""
    folder = folder or model.parent / f"{model.name}-loras"
    paths = []
    for i in range(count):
        out = folder / f"r{rank}-{i}"
        if not (out / "adapter_model.safetensors").is_file():
            make_lora_adapter(model, out, rank=rank, seed=100 + i)
        paths.append(out)
    return paths


def _generate(llm: LLM, requests: list[BenchRequest], loras: list[LoRARequest] | None) -> tuple[EngineRunResult, list]:
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    per_request = None if loras is None else [loras[i % len(loras)] for i in range(len(requests))]
    executor, steps = llm.engine_core.executor, llm.stats.steps
    forward, preemptions = executor.forward_seconds, llm.stats.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=per_request)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    result = EngineRunResult(seconds, sum(map(len, tokens)), executor.forward_seconds - forward,
                             llm.stats.steps - steps, llm.stats.num_preemptions - preemptions)
    return result, tokens


def _cold_start(llm: LLM, cold: LoRARequest, warm: LoRARequest) -> dict:
    """One 128-token prompt, 8 tokens out, on a never-seen adapter, then on a resident one."""
    prompt = [{"prompt_token_ids": [7 + i % 500 for i in range(128)]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    latency = {}
    for name, lora in (("cold", cold), ("warm", warm)):
        start = time.perf_counter()
        llm.generate(prompt, params, lora_request=lora)
        latency[name] = time.perf_counter() - start
    read = llm.engine_core.lora_loader.load_seconds[cold.lora_name]
    return {"cold_request_s": latency["cold"], "warm_request_s": latency["warm"], "adapter_read_s": read}


def main(args: argparse.Namespace) -> int:
    model = Path(args.model)
    paths = adapters_for(model, args.num_adapters + _COLD, args.lora_rank, args.adapters_dir)
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    mixed, cold = loras[: args.num_adapters], loras[-1]
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
              enable_prefix_caching=False, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=max(16, args.lora_rank), max_cpu_loras=args.num_adapters + _COLD)
    requests = sharegpt_like(llm.get_tokenizer(), args.num_requests, args.max_prompt_len, args.max_output_len,
                             args.seed)
    warm_up = requests[: 2 * args.num_adapters]
    _generate(llm, warm_up, mixed)  # reads every mixed adapter once, outside the timed rounds
    runs: dict[str, list[EngineRunResult]] = {"base": [], "mixed": []}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for side in rotated(["base", "mixed"], r):
            result, tokens[side] = _generate(llm, requests, None if side == "base" else mixed)
            runs[side].append(result)
            print(f"round {r + 1} {side:>5}: {result.tokens_per_second:7.1f} tok/s ({result.steps} steps)")
    changed = sum(a != b for a, b in zip(tokens["base"], tokens["mixed"]))
    medians = {side: statistics.median(x.tokens_per_second for x in rs) for side, rs in runs.items()}
    ratio = medians["mixed"] / medians["base"]
    cold_start = _cold_start(llm, cold, mixed[0])
    print(f"{args.num_requests} requests, {args.num_adapters} adapters of rank {args.lora_rank}, dtype "
          f"{llm.config.model.dtype}: base {medians['base']:.1f} tok/s, mixed {medians['mixed']:.1f} tok/s "
          f"(medians of {args.rounds} alternated rounds): mixed / base = {ratio:.2f}x; the adapters changed "
          f"{changed} of {len(requests)} outputs")
    print(f"cold adapter: read {1e3 * cold_start['adapter_read_s']:.1f} ms; a 128-token request took "
          f"{1e3 * cold_start['cold_request_s']:.0f} ms on it against {1e3 * cold_start['warm_request_s']:.0f} ms "
          "on a resident adapter")
    llm.shutdown()
    write_report({
        "num_requests": len(requests), "num_adapters": args.num_adapters, "lora_rank": args.lora_rank,
        "dtype": str(llm.config.model.dtype), "rounds": args.rounds,
        "tokens_per_second": {side: [x.tokens_per_second for x in rs] for side, rs in runs.items()},
        "median_tokens_per_second": medians, "mixed_over_base": ratio, "outputs_changed": changed,
        "cold_start": cold_start,
    }, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("lora", help="a batch mixing LoRA adapters vs the base model alone, and an adapter's "
                                      "cold start")
    add_common_args(p)
    add_device_arg(p)
    p.add_argument("--num-adapters", type=positive_int, default=4, help="adapters the mixed batch cycles through")
    p.add_argument("--lora-rank", type=positive_int, default=16)
    p.add_argument("--adapters-dir", type=Path, default=None,
                   help="where the random adapters are written (default: beside the model, <model>-loras)")
    p.add_argument("--num-requests", type=positive_int, default=128)
    p.add_argument("--max-prompt-len", type=positive_int, default=512)
    p.add_argument("--max-output-len", type=positive_int, default=256)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--kv-cache-gib", type=positive_float, default=4.0)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.set_defaults(bench_func=main)
