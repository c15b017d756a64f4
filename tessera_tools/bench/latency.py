"""``tessera bench latency``: the end-to-end latency of one fixed batch, as
`vllm bench latency` measures it, with its flags and defaults (32 prompt
tokens, 128 output tokens, batch 8, 10 warm-up and 30 measured iterations).

Each iteration sends the same batch of random-token prompts, greedy with
`ignore_eos` so every output is exactly --output-len tokens, and times it
until the last request ends. Two targets:

- the offline engine (the default): --model is a checkpoint and every engine
  flag (`tessera engine --help`) applies, so the batch runs under the
  settings a deployment would use;
- a running endpoint (--base-url, any OpenAI-compatible server: Tessera's
  gateway, vLLM's server): --model is the served model's
  name, the batch goes as concurrent `/completions` requests (prompts as
  token ids), and the bearer token comes from $OPENAI_API_KEY, never a flag.

    tessera bench latency --model models/bench --output bench-results/latency.json
    tessera bench latency --base-url http://127.0.0.1:8000/v1 --model tiny --batch-size 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

from tessera_tools.bench.common import write_report
from tessera_tools.bench.flags import int_at_least, non_negative_int, positive_int
from tessera_tools.bench.stats import percentile

# What `vllm bench latency` prints and writes.
PERCENTILES = (10, 25, 50, 75, 90, 99)
# Token ids for the random prompts: above the ids tokenizers give special tokens.
FIRST_PROMPT_TOKEN = 10


class LatencyError(RuntimeError):
    """A run that cannot give a figure: a bad input (exit status 2) or a
    target that fails (an endpoint refusing, outputs of the wrong length: 1)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """The batch's prompts: `batch_size` lists of `input_len` random token ids."""
    if vocab_size <= FIRST_PROMPT_TOKEN:
        raise LatencyError(f"a vocabulary of {vocab_size} tokens is too small for random prompts", 2)
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def measure(run_batch: Callable[[], None], warmup: int, iterations: int, progress: bool = True) -> list[float]:
    """Seconds of each of `iterations` calls of `run_batch`, after `warmup` untimed ones."""
    for _ in range(warmup):
        run_batch()
    latencies = []
    for i in range(iterations):
        start = time.perf_counter()
        run_batch()
        latencies.append(time.perf_counter() - start)
        if progress:
            print(f"\riteration {i + 1}/{iterations}: {latencies[-1] * 1e3:.1f} ms", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    return latencies


def summarise(latencies: list[float], batch_size: int, output_len: int) -> dict:
    """vLLM's figures (avg_latency, latencies, percentiles, in seconds) plus
    the batch's output tokens per second at the median."""
    median = statistics.median(latencies)
    return {
        "avg_latency": statistics.fmean(latencies),
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in PERCENTILES},
        "output_tokens_per_second_at_median": batch_size * output_len / median,
    }


# -- the offline engine ---------------------------------------------------------

def _offline_batch(args: argparse.Namespace) -> tuple[Callable[[], None], dict]:
    from engine_pod import LLM, SamplingParams
    from engine_pod.entrypoints.cli_args import engine_kwargs

    llm = LLM(args.model, **engine_kwargs(args))
    limit = llm.config.model.max_model_len
    if args.input_len + args.output_len > limit:
        raise LatencyError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the engine's "
                           f"max_model_len {limit}", 2)
    prompts = [{"prompt_token_ids": p}
               for p in random_prompts(args.batch_size, args.input_len, llm.config.model.arch.vocab_size, args.seed)]
    params = SamplingParams(n=args.n, temperature=0.0 if args.n == 1 else 1.0, max_tokens=args.output_len,
                            ignore_eos=True, seed=args.seed)

    def run_batch() -> None:
        outputs = llm.generate(prompts, params)
        _check_lengths([len(c.token_ids) for o in outputs for c in o.outputs], args)

    engine = {"dtype": str(llm.config.model.dtype), "device": str(llm.config.device),
              "max_num_seqs": llm.config.scheduler.max_num_seqs,
              "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens}
    return run_batch, engine


def _check_lengths(lengths: list[int], args: argparse.Namespace) -> None:
    expected = args.batch_size * args.n
    if len(lengths) != expected or any(n != args.output_len for n in lengths):
        raise LatencyError(f"expected {expected} outputs of {args.output_len} tokens, got lengths {lengths}")


# -- a running endpoint -----------------------------------------------------------

def _endpoint_batch(args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """One iteration against the endpoint: the batch as concurrent requests, run on `loop`."""
    import json

    from tessera_tools.bench.serve.client import ServeClient

    client = ServeClient(args.base_url, os.environ.get("OPENAI_API_KEY"), args.request_timeout)
    loop.run_until_complete(client.__aenter__())
    ids = loop.run_until_complete(client.model_ids())
    if args.model not in ids:
        raise LatencyError(f"{args.base_url} serves {ids}, not {args.model!r} (--model)", 2)
    prompts = random_prompts(args.batch_size, args.input_len, args.vocab_size, args.seed)

    async def one(prompt: list[int]) -> list[int]:
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len, "n": args.n,
                "temperature": 0.0 if args.n == 1 else 1.0, "ignore_eos": True, "seed": args.seed}
        status, raw = await client.call("POST", "/completions", json=body)
        if status != 200:
            raise LatencyError(f"POST {args.base_url}/completions: HTTP {status}: {raw[:300]!r}")
        return _completion_lengths(json.loads(raw), args)

    async def batch() -> None:
        lengths = await asyncio.gather(*(one(p) for p in prompts))
        _check_lengths([n for each in lengths for n in each], args)

    return lambda: loop.run_until_complete(batch())


def _completion_lengths(body: dict, args: argparse.Namespace) -> list[int]:
    """Output tokens of a response's n choices as _check_lengths takes them:
    OpenAI's usage counts the choices together, so only its total is known
    (one entry, the total, when it is not n x --output-len)."""
    total = body["usage"]["completion_tokens"]
    return [args.output_len] * args.n if total == args.n * args.output_len else [total]


# -- the command ----------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    loop = asyncio.new_event_loop()
    try:
        if args.base_url:
            run_batch = _endpoint_batch(args, loop)
            target: dict = {"base_url": args.base_url, "model": args.model}
        else:
            run_batch, engine = _offline_batch(args)
            target = {"model": args.model, "engine": engine}
        latencies = measure(run_batch, args.num_iters_warmup, args.num_iters, progress=not args.no_progress)
    except LatencyError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    except ValueError as e:  # the engine's refusal of a flag's value
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, OSError, RuntimeError) as e:  # an endpoint unreachable or refusing
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    report = {"target": target, "input_len": args.input_len, "output_len": args.output_len,
              "batch_size": args.batch_size, "n": args.n, "num_iters": args.num_iters,
              **summarise(latencies, args.batch_size * args.n, args.output_len)}
    print(f"Avg latency: {report['avg_latency']:.4f} seconds")
    for q, value in report["percentiles"].items():
        print(f"{q}% percentile latency: {value:.4f} seconds")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    from engine_pod.entrypoints.cli_args import add_engine_args

    p = kinds.add_parser("latency", help="end-to-end latency of one fixed batch (vLLM's bench latency), "
                                         "offline or against an OpenAI-compatible endpoint")
    w = p.add_argument_group("the batch (vLLM's defaults)")
    w.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens per request")
    w.add_argument("--output-len", type=positive_int, default=128, help="output tokens per request (ignore_eos)")
    w.add_argument("--batch-size", type=positive_int, default=8, help="requests per iteration")
    w.add_argument("--n", type=positive_int, default=1, help="outputs per prompt (n > 1 samples at temperature 1)")
    w.add_argument("--num-iters-warmup", type=non_negative_int, default=10, help="untimed iterations first")
    w.add_argument("--num-iters", type=positive_int, default=30, help="timed iterations")
    w.add_argument("--seed", type=int, default=0, help="the prompts' and sampling's seed")
    e = p.add_argument_group("a running endpoint instead of the offline engine")
    e.add_argument("--base-url", default=None, help="the API root, e.g. http://127.0.0.1:8000/v1 (--model then "
                                                    "names the served model; $OPENAI_API_KEY is the bearer token)")
    e.add_argument("--vocab-size", type=int_at_least(FIRST_PROMPT_TOKEN + 1), default=32000,
                   help="the range of the random prompt token ids against an endpoint")
    e.add_argument("--request-timeout", type=positive_int, default=600, help="seconds per request at most")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no per-iteration line on stderr")
    add_engine_args(p)  # --model and the engine's flags (offline)
    p.set_defaults(bench_func=main)

