"""vLLM's offline engine as a benchmark peer: run by the Python of vLLM's own virtual
environment (`make vllm-venv`), never imported by Tessera; stdlib and vllm only.

The parent (tessera_tools/bench/peers/vllm_peer.py) speaks JSON lines with it. The first line on
stdin is the engine's settings; the worker builds `vllm.LLM`, warms it up and answers
{"ready": ...}. Each later line is {"requests": [[prompt token ids, output length], ...]}:
the worker generates them greedily (ignore_eos, every output its exact length), timing
`generate` alone, and answers {"seconds": s, "token_ids": [...], "cached_tokens": [...],
"ttft_s": [...]} (per request: prompt tokens served from its prefix cache, and seconds from
arrival to first token, null unless the settings ask for "log_stats"); with "profile": true it runs
under torch's profiler and adds "operators": [[name, self seconds, calls], ...] (the engine must
then run in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0). An empty line or end of
input stops it. Its answers go to the stdout it was given; everything else it or vLLM prints
goes to stderr, so a log line can never be taken for an answer.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _answer_channel():
    """The protocol's stream: the original stdout; fd 1 from here on is stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _ttft(output) -> float | None:
    """Seconds from the request's arrival to its first token: vLLM's own per-request stat,
    kept only when its engine logs stats (disable_log_stats=False)."""
    return getattr(output.metrics, "first_token_latency", None) if output.metrics is not None else None


def _generate(llm, params_type, prompt_type, requests) -> dict:
    prompts = [prompt_type(prompt_token_ids=ids) for ids, _ in requests]
    params = [params_type(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "cached_tokens": [o.num_cached_tokens or 0 for o in outputs], "ttft_s": [_ttft(o) for o in outputs]}


def _profiled(llm, params_type, prompt_type, requests) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        answer = _generate(llm, params_type, prompt_type, requests)
    answer["operators"] = [[e.key, e.self_cpu_time_total / 1e6, e.count] for e in prof.key_averages()]
    return answer


def main() -> int:
    # Run as a script, its folder leads sys.path: no module beside it may stand in for vllm's.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    channel = _answer_channel()
    settings = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=settings["model"], dtype=settings["dtype"], max_num_seqs=settings["max_num_seqs"],
              max_num_batched_tokens=settings["max_num_batched_tokens"],
              enable_prefix_caching=settings["enable_prefix_caching"], seed=settings["seed"],
              max_model_len=settings.get("max_model_len"),
              disable_log_stats=not settings.get("log_stats", False))
    _generate(llm, SamplingParams, TokensPrompt, [([5] * 64, 4)] * 4)  # warm-up, as Tessera's side does
    channel.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        command = json.loads(line)
        requests = command["requests"]
        run = _profiled if command.get("profile") else _generate
        answer = run(llm, SamplingParams, TokensPrompt, requests)
        channel.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
