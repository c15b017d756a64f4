"""``tessera bench serve``: a serving benchmark against any OpenAI-compatible
endpoint (Tessera's gateway or another server), with the request arrivals,
metrics and names of `vllm bench serve`.

    tessera bench serve --base-url http://127.0.0.1:8000/v1 --request-rates 1,2,4,8 \\
        --num-prompts 100 --output-json bench-results/serve.json --plot-dir bench-results/serve

Against vLLM's server, both started by the command (serve/peer.py):

    tessera bench serve --peer vllm --serve-model models/bench --request-rates 1,2,4 \
        --goodput ttft:2000 tpot:200 --output-json bench-results/serve-vs-vllm.json
"""

from __future__ import annotations

import argparse
import sys

from tessera_tools.bench.flags import (
    add_logs_arg,
    cpu_list,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)


def _run(args: argparse.Namespace) -> int:
    # aiohttp, transformers: only when the command runs.
    if args.background_batch:
        if args.peer:
            print("error: --background-batch measures one platform: drop --peer", file=sys.stderr)
            return 2
        if bool(args.base_url) == bool(args.serve_model):
            print("error: --background-batch needs --base-url (a gateway with the Batch API on) or "
                  "--serve-model (the command starts one), not both", file=sys.stderr)
            return 2
        from tessera_tools.bench.serve.background import main
    elif args.peer:
        if args.base_url:
            print("error: --peer vllm starts both servers itself: drop --base-url", file=sys.stderr)
            return 2
        if not args.serve_model:
            print("error: --peer vllm needs --serve-model, the checkpoint both servers load", file=sys.stderr)
            return 2
        from tessera_tools.bench.serve.peer import main
    else:
        if not args.base_url:
            print("error: --base-url is required (or --peer vllm with --serve-model)", file=sys.stderr)
            return 2
        from tessera_tools.bench.serve.runner import main
    return main(args)


def add_parser(kinds) -> None:
    p = kinds.add_parser("serve", help="latency and throughput of an OpenAI-compatible endpoint under load")
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="the API root, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--api-key", default=None,
                        help="bearer token (default: $OPENAI_API_KEY, else none; --peer: not used)")
    target.add_argument("--model", default=None,
                        help="model name to request (default: the first of GET /models; --peer: not used)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions (text prompt) or /v1/chat/completions (messages)")
    target.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send ignore_eos (by default it is sent, and dropped if the server refuses it)")
    target.add_argument("--request-timeout", type=positive_float, default=600.0,
                        help="seconds a request may wait for its next bytes before it counts as failed")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-path", default=None,
                      help='JSONL: {"prompt": TEXT, "output_len": N} or {"messages": [...], "output_len": N} per line '
                           "(default: the seeded synthetic ShareGPT-like workload)")
    data.add_argument("--tokenizer", default=None,
                      help="checkpoint folder whose tokenizer measures prompt lengths (default: Tessera's preset one)")
    data.add_argument("--num-prompts", type=positive_int, default=200, help="requests per rate")
    data.add_argument("--max-prompt-len", type=positive_int, default=512, help="synthetic: longest prompt, in tokens")
    data.add_argument("--max-output-len", type=positive_int, default=256, help="synthetic: longest output, in tokens")
    data.add_argument("--prefix-groups", type=non_negative_int, default=0,
                      help="each request starts with one of this many shared prefixes (0: none)")
    data.add_argument("--prefix-len", type=positive_int, default=256, help="tokens of each shared prefix")
    data.add_argument("--seed", type=int, default=0, help="seed of the dataset, prefix choice and arrivals")

    load = p.add_argument_group("load")
    rates = load.add_mutually_exclusive_group()
    rates.add_argument("--request-rate", default="inf", help="requests/s, or inf: all at once (default)")
    rates.add_argument("--request-rates", default=None, help="a sweep, comma-separated, e.g. 1,2,4,8,inf")
    load.add_argument("--burstiness", type=positive_float, default=1.0,
                      help="gamma shape of the arrivals: 1 Poisson, < 1 burstier, > 1 more even")
    load.add_argument("--max-concurrency", type=positive_int, default=None, help="at most this many requests in flight")
    load.add_argument("--num-warmups", type=non_negative_int, default=1,
                      help="unmeasured requests sent one by one first")

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    out.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99")
    out.add_argument("--output-json", default="bench-results/serve.json", help="write the results as JSON here")
    out.add_argument("--plot-dir", default=None, help="write PNG plots here")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _add_peer_args(p)
    _add_background_args(p)
    p.set_defaults(bench_func=_run)


def _add_background_args(p: argparse.ArgumentParser) -> None:
    from engine_pod.config import SchedulerConfig

    bg = p.add_argument_group("background batch: interactive latency with a batch job running (docs/batch.md)")
    bg.add_argument("--background-batch", type=non_negative_int, default=0, metavar="LINES",
                    help="per rate, run the interactive requests alone and with a batch of this many lines "
                         "running (the Batch API), turn about; --rounds, --cooldown apply")
    bg.add_argument("--background-max-tokens", type=positive_int, default=128, help="output tokens of each batch line")
    bg.add_argument("--background-warmup", type=non_negative_float, default=5.0,
                    help="seconds the batch runs before the interactive requests start")
    bg.add_argument("--background-concurrency", type=positive_int, default=8,
                    help="--serve-model: the gateway's batch.max_concurrency (batch lines in flight)")
    bg.add_argument("--background-max-batched-tokens", type=positive_int,
                    default=SchedulerConfig.background_max_batched_tokens,
                    help="--serve-model: the engine's --background-max-batched-tokens")
    bg.add_argument("--no-background-yield", action="store_true",
                    help="--serve-model: start the engine without --background-priority (batch lines are "
                         "only lower-priority requests), to see what yielding buys")


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    peer = p.add_argument_group("peer: Tessera against `vllm serve`, both started by the command (docs/benchmarks.md)")
    peer.add_argument("--peer", choices=("vllm",), default=None,
                      help="start Tessera (engine pod + gateway) and vLLM's server (make vllm-venv) on --serve-model "
                           "and run the sweep on both, turn about")
    peer.add_argument("--serve-model", default=None, help="the checkpoint folder both servers load")
    peer.add_argument("--dtype", default="auto", help="bfloat16 or float32 (auto: the checkpoint's)")
    peer.add_argument("--max-num-seqs", type=positive_int, default=256)
    peer.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    peer.add_argument("--max-model-len", type=positive_int, default=None, help="default: the checkpoint's")
    peer.add_argument("--kv-cache-gib", type=positive_int, default=4, help="KV cache of each server, GiB")
    peer.add_argument("--no-prefix-caching", action="store_true", help="prefix caching off on both")
    peer.add_argument("--rounds", type=positive_int, default=1, help="alternated runs of each server per rate")
    peer.add_argument("--cooldown", type=non_negative_int, default=10,
                      help="seconds of quiet before each measured run (the server that ran before may still be busy)")
    peer.add_argument("--sustained-fraction", type=positive_float, default=0.9,
                      help="a rate counts as sustained when completed requests/s reach this share of it")
    peer.add_argument("--peer-cpus", type=cpu_list, default="0-1",
                      help="cores of vLLM's OpenMP threads; Tessera's pod gets as many torch threads")
    add_logs_arg(p)
