"""``tessera bench pd``: mixed serving vs prefill/decode disaggregation, its
KV moved through Redis or pushed directly to the decode pod.

Three set-ups, each a gateway in front of two pods of its own
(pd_platform.py): mixed (two mixed pods), redis (prefill + decode pod,
kv_channel redis) and direct (prefill + decode pod with an inbox, kv_channel
direct). Every round draws new random-token prompts from a seeded RNG and
sends the same ones through each set-up, in an order that rotates per round;
the prompts are new to every pod (a set-up has pods and a Redis of its own,
and a round's prompts are fresh), so each set-up computes each prompt, as
the pods' prefix-cache counters confirm. Requests stream through the
gateway with `tessera bench serve`'s client (TTFT, ITL, E2E, goodput); the
pods' counters tell where the time and the bytes went (pd_report.py).
The whole comparison runs once per TP degree in --tp.

    tessera bench pd --model models/bench --tp 1,2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from tessera_tools.bench.common import rotated, write_report
from tessera_tools.bench.flags import (
    DTYPE_HELP, MODEL_HELP, non_negative_int, positive_float, positive_int, positive_int_list,
)

PERCENTILES = [50.0, 90.0]
# Seconds of quiet between two set-ups' runs: a prefill pod's write-behind to
# Redis, or a stream's tail, must not land in the next set-up's run.
QUIET_S = 1.0
# The lowest token id drawn: below it sit the checkpoints' special tokens.
FIRST_PLAIN_TOKEN = 5


# -- flag types -------------------------------------------------------------------
def mode_list(text: str) -> list[str]:
    """"mixed,direct" -> ["mixed", "direct"]: known set-ups, each once."""
    from tessera_tools.bench.pd_platform import MODES

    modes = [m.strip() for m in text.split(",")]
    if not all(m in MODES for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct modes among {','.join(MODES)}, got {text!r}")
    return modes


def request_rate(text: str) -> float:
    """Requests/s of the Poisson arrivals: bench serve's rate (a number > 0, or inf: all at once)."""
    from tessera_tools.bench.serve.arrivals import parse_rate

    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def slo_spec(text: str) -> tuple[str, float]:
    """One goodput SLO as `bench serve --goodput` takes it: NAME:MS."""
    from tessera_tools.bench.serve.metrics import parse_slos

    try:
        ((name, ms),) = parse_slos([text]).items()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None  # the message names the spec
    return name, ms


# -- the workload -----------------------------------------------------------------
def _model_limits(model: Path) -> tuple[int, int]:
    """The checkpoint's vocabulary size and longest sequence (config.json)."""
    config = json.loads((model / "config.json").read_text())
    return config["vocab_size"], config["max_position_embeddings"]


def random_prompts(count: int, length: int, vocab_size: int, seed: str) -> list[list[int]]:
    """`count` prompts of `length` random token ids: the seed (the round's) decides them all."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length)] for _ in range(count)]


def _requests(prompts: list[list[int]], output_tokens: int) -> list:
    from tessera_tools.bench.serve.dataset import ServeRequest

    # Token ids as the prompt (OpenAI's /v1/completions takes them): exact lengths, no tokenizer.
    return [ServeRequest(output_len=output_tokens, prompt=ids, prompt_len=len(ids))  # type: ignore[arg-type]
            for ids in prompts]


async def _send(api_root: str, requests: list, offsets: list[float], rate: float, concurrency: int | None,
                slos: dict[str, float]) -> dict:
    from tessera_tools.bench.serve.client import ServeClient, Target
    from tessera_tools.bench.serve.load import run_at_rate
    from tessera_tools.bench.serve.metrics import summarize
    from tessera_tools.bench.pd_platform import MODEL_NAME

    async with ServeClient(api_root, request_timeout_s=600.0) as client:
        target = Target(client.base_url, "completions", MODEL_NAME)
        run = await run_at_rate(client, target, requests, offsets, rate, concurrency, progress=False)
    return summarize(run.outcomes, run.duration_s, PERCENTILES, slos)


# -- the runs ---------------------------------------------------------------------
def _warm_up(args: argparse.Namespace, running: dict, vocab_size: int, tp: int, slos: dict[str, float]) -> None:
    """Unmeasured requests through every set-up, all at once: first passes are slow
    (allocations, the kernels' first shapes). Prompts of their own: no round's are cached."""
    if not args.warmup:
        return
    prompts = random_prompts(args.warmup, args.prompt_tokens, vocab_size, f"{args.seed}-{tp}-warmup")
    warm = _requests(prompts, args.output_tokens)
    for platform in running.values():
        asyncio.run(_send(platform.api_root, warm, [0.0] * len(warm), math.inf, None, slos))


def _run_round(args: argparse.Namespace, running: dict, vocab_size: int, tp: int, r: int,
               slos: dict[str, float]) -> list:
    """Round `r`: new prompts, the same ones through every set-up, in this round's order."""
    from tessera_tools.bench.pd_platform import counter_deltas
    from tessera_tools.bench.pd_report import RoundResult
    from tessera_tools.bench.serve.arrivals import arrival_offsets

    requests = _requests(random_prompts(args.requests, args.prompt_tokens, vocab_size, f"{args.seed}-{tp}-{r}"),
                         args.output_tokens)
    offsets = arrival_offsets(len(requests), args.rate, seed=args.seed + r)
    out = []
    for position, mode in enumerate(rotated(args.modes, r)):
        time.sleep(QUIET_S)
        platform = running[mode]
        before = platform.counters()
        summary = asyncio.run(_send(platform.api_root, requests, offsets, args.rate, args.concurrency or None, slos))
        out.append((mode, RoundResult(r, position, summary, counter_deltas(before, platform.counters()))))
        print(f"TP={tp} round {r + 1}/{args.rounds} {mode:>6}: TTFT p50 {summary['p50_ttft_ms'] or 0:,.0f} ms, "
              f"{summary['completed']} completed, {summary['failed']} failed", flush=True)
    return out


def _run_tp(args: argparse.Namespace, tp: int, model: Path, vocab_size: int, work: Path) -> dict:
    """The whole comparison at one TP degree: the set-ups started, warmed up, measured, stopped."""
    from tessera_tools.bench.pd_platform import PodSettings, platforms
    from tessera_tools.bench.pd_report import mode_result, ttft_ratios

    pods = PodSettings(model, args.dtype, tp, args.threads_per_rank, args.kv_cache_mib << 20, args.inbox_mib << 20,
                       args.max_num_batched_tokens, args.simulate, args.redis_mib << 20, args.kv_redis_timeout)
    slos = dict(args.goodput)
    results: dict[str, list] = {mode: [] for mode in args.modes}
    started = time.monotonic()
    with platforms(args.modes, pods, args.min_uncached_tokens, work / f"tp{tp}") as running:
        print(f"TP={tp}: {len(running)} set-ups serving after {time.monotonic() - started:.0f} s; logs in "
              f"{work / f'tp{tp}'}", flush=True)
        _warm_up(args, running, vocab_size, tp, slos)
        for r in range(args.rounds):
            for mode, result in _run_round(args, running, vocab_size, tp, r, slos):
                results[mode].append(result)
    return {"tp": tp, "modes": {mode: mode_result(rs) for mode, rs in results.items()},
            "ratios": ttft_ratios(results)}


def _check_settings(args: argparse.Namespace, max_len: int) -> str | None:
    """What makes the asked comparison impossible, before anything starts."""
    if args.prompt_tokens + args.output_tokens > max_len:
        return (f"--prompt-tokens {args.prompt_tokens} + --output-tokens {args.output_tokens} exceed the model's "
                f"{max_len} positions (max_position_embeddings)")
    if args.simulate is not None and (args.tp != [1] or args.dtype != "auto"):
        return ("--simulate: a simulated pod is one process in no dtype (its profile models the GPU's); "
                "leave --tp at 1 and --dtype at auto")
    if set(args.modes) - {"mixed"} and args.prompt_tokens < args.min_uncached_tokens:
        return (f"--prompt-tokens {args.prompt_tokens} < --min-uncached-tokens {args.min_uncached_tokens}: the "
                "gateway would not disaggregate these prompts")
    return None


def _print_results(report: dict) -> None:
    from tessera_tools.bench.pd_report import ratio_lines, table

    s = report["settings"]
    print(f"\n{s['requests']} requests of {s['prompt_tokens']} random tokens + {s['output_tokens']} output per "
          f"round, rate {s['rate']} req/s, concurrency {s['concurrency'] or 'unbounded'}; medians of "
          f"{s['rounds']} rounds (modes rotated); counters summed over the rounds\n")
    print(table(report["results"]))
    for line in ratio_lines(report["results"]) + [f"check failed: {p}" for p in report["problems"]]:
        print(line)


def main(args: argparse.Namespace) -> int:
    from tessera_tools.bench.pd_report import checks

    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"error: --model {model}: no config.json there (make bench-models builds models/bench)",
              file=sys.stderr)
        return 2
    vocab_size, max_len = _model_limits(model)
    problem = _check_settings(args, max_len)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    work = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="tessera-bench-pd-"))
    # SIGTERM unwinds like Ctrl-C, so every pod, gateway and Redis is stopped on the way out.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        by_tp = [_run_tp(args, tp, model, vocab_size, work) for tp in args.tp]
    except (RuntimeError, TimeoutError) as e:  # a pod or gateway that did not start: its log says why
        print(f"error: {e}; logs in {work}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # every process was stopped on the way out
        print(f"interrupted: pods, gateways and Redis stopped; logs in {work}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    problems = [p for entry in by_tp for mode, result in entry["modes"].items()
                for p in checks(mode, result, args.requests * args.rounds)]
    settings = {k: getattr(args, k) for k in ("model", "simulate", "dtype", "prompt_tokens", "output_tokens",
                                              "requests", "rate", "concurrency", "rounds", "warmup", "tp", "modes",
                                              "min_uncached_tokens", "threads_per_rank", "kv_cache_mib", "redis_mib",
                                              "kv_redis_timeout", "inbox_mib", "max_num_batched_tokens", "seed")}
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "settings": {**settings, "rate": "inf" if math.isinf(args.rate) else args.rate,
                           "goodput_slos_ms": dict(args.goodput)},
              "logs": str(work), "results": by_tp, "problems": problems}
    _print_results(report)
    write_report(report, args.out)
    failed = sum(result["failed"] for entry in by_tp for result in entry["modes"].values())
    return 1 if failed else 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("pd", help="mixed pods vs P/D disaggregation over Redis vs P/D with direct KV pushes")
    p.add_argument("--model", default="models/bench", help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--prompt-tokens", type=positive_int, default=2016,
                   help="random tokens per prompt (prompt + output must fit the model's positions)")
    p.add_argument("--output-tokens", type=positive_int, default=32)
    p.add_argument("--requests", type=positive_int, default=8, help="requests per set-up and round")
    p.add_argument("--rate", type=request_rate, default=math.inf,
                   help="requests/s of Poisson arrivals, or inf: all at once (then --concurrency paces them)")
    p.add_argument("--concurrency", type=non_negative_int, default=1,
                   help="at most this many requests in flight (0: no cap; the default 1 measures each hand-off "
                        "without queueing)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds; the set-ups' order rotates each round")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="unmeasured requests per set-up, all at once, before the first round")
    p.add_argument("--tp", type=positive_int_list, default=[1],
                   help="TP degrees, comma-separated: the whole comparison runs at each")
    p.add_argument("--modes", type=mode_list, default=["mixed", "redis", "direct"],
                   help="set-ups to compare, comma-separated: mixed, redis, direct (over the decode pod's inbox "
                        "socket), direct-grpc (the same over the PushKVBlocks stream)")
    p.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="simulated pods (engine --simulate): the real scheduler, KV store, Redis and channels, "
                        "the forward replaced by this step-time profile; with a shape-only model "
                        "(make-model --preset sim-llama3.1-8b) the pods move an 8B's KV at GPU-class step times")
    p.add_argument("--goodput", type=slo_spec, nargs="+", default=[("ttft", 10000.0), ("tpot", 200.0)],
                   metavar="NAME:MS", help="goodput SLOs as bench serve takes them (ttft, tpot = a request's mean "
                                           "ITL, e2el), default ttft:10000 tpot:200")
    p.add_argument("--min-uncached-tokens", type=non_negative_int, default=256,
                   help="the gateway's disaggregation threshold (P/D set-ups)")
    p.add_argument("--threads-per-rank", type=positive_int, default=1,
                   help="torch threads per TP rank of each pod (a pod gets TP times this many)")
    p.add_argument("--kv-cache-mib", type=positive_int, default=512, help="KV cache of each pod, MiB")
    p.add_argument("--redis-mib", type=positive_int, default=4096,
                   help="each P/D set-up's private Redis: memory at most, MiB (least recently used keys out)")
    p.add_argument("--kv-redis-timeout", type=positive_float, default=None,
                   help="the pods' Redis socket timeout, seconds (default: the engine's); an 8B-sized prompt's "
                        "hundreds of MB on a busy 2-core host can outlast the default, and a timeout is a miss")
    p.add_argument("--inbox-mib", type=positive_int, default=1024,
                   help="the direct set-up's decode pod: budget of pushed blocks (--kv-inbox-bytes), MiB")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="the pods' step budget (default: the engine's; below the prompt length prefills come in "
                        "chunks, which a direct push overlaps)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument("--logs", default=None,
                   help="pod, gateway and Redis folders go here (default: a new folder under the system's "
                        "temporary directory, kept)")
    p.add_argument("--out", default="bench-results/pd.json", help="write the results as JSON here")
    p.set_defaults(bench_func=main)
