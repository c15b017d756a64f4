"""``tessera bench tp-overhead``: what the multi-process executor's channel
costs per step.

The same decode batch runs through two engines over one checkpoint: the
model in the engine's own process (UniProcExecutor), and one rank in a worker
process behind MultiProcExecutor (the shared-memory broadcast of the
scheduler output, the worker's wake-up, and the result pipe back). Two
figures per step: the difference of median step times (end to end, noisy on
a shared CPU), and the channel time the executor attributes directly (each
execute_model's wall time minus the time the worker spent in the call).
Rounds alternate between the engines so machine load drifts evenly.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine_pod.config import create_engine_config
from engine_pod.engine.engine_core import EngineCore
from engine_pod.executor.multiproc import MultiProcExecutor
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from tessera_tools.bench.common import rotated, write_report
from tessera_tools.bench.flags import add_common_args, positive_int


def _decode_step_seconds(
    core: EngineCore, num_requests: int, prompt_len: int, steps: int, tag: str
) -> tuple[list[float], float]:
    """Admit a batch, run its prefill, then time ``steps`` steps in which
    every request decodes one token; abort the rest. Returns the step times
    and the channel seconds per timed step (0 in process)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(num_requests)]
    for i, rid in enumerate(ids):
        prompt = [(7 + 13 * i + j) % 4000 + 5 for j in range(prompt_len)]
        core.add_request(Request(rid, prompt, params))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    channel_before = getattr(core.executor, "channel_seconds", 0.0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    channel = (getattr(core.executor, "channel_seconds", 0.0) - channel_before) / steps
    core.abort_requests(ids)
    return times, channel


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    config = create_engine_config(
        args.model, dtype=args.dtype, device="cpu", max_model_len=args.prompt_len + args.steps + 64,
        kv_cache_memory_bytes=int(args.kv_cache_mib) << 20, max_num_seqs=args.num_requests,
        max_num_batched_tokens=max(2048, args.num_requests * args.prompt_len), worker_threads=args.threads,
    )
    in_process = EngineCore(config)
    executor = MultiProcExecutor(config, world_size=1)
    through_worker = EngineCore(config, executor=executor)
    engines = {"in_process": in_process, "multiproc": through_worker}
    medians: dict[str, list[float]] = {name: [] for name in engines}
    channel_per_step = []
    try:
        for r in range(args.rounds + 1):  # round 0 warms up both
            for name, core in rotated(list(engines.items()), r):
                times, channel = _decode_step_seconds(
                    core, args.num_requests, args.prompt_len, args.steps, f"{name}-{r}"
                )
                if r == 0:
                    continue
                medians[name].append(statistics.median(times))
                if core is through_worker:
                    channel_per_step.append(channel)
    finally:
        through_worker.shutdown()
        in_process.shutdown()
    in_ms = statistics.median(medians["in_process"]) * 1e3
    mp_ms = statistics.median(medians["multiproc"]) * 1e3
    channel_ms = statistics.median(channel_per_step) * 1e3
    report = {
        "model": args.model,
        "num_requests": args.num_requests,
        "threads": args.threads,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "median_step_ms": {"in_process": in_ms, "multiproc": mp_ms},
        "step_time_difference_ms": mp_ms - in_ms,
        "channel_ms_per_step": channel_ms,
        "broadcast_bytes_decode_step": executor.last_broadcast_bytes,
        "per_round_median_step_ms": {k: [x * 1e3 for x in v] for k, v in medians.items()},
    }
    print(f"{args.num_requests}-request decode step, TP=1: in process {in_ms:.2f} ms, through MultiProcExecutor "
          f"{mp_ms:.2f} ms (difference {mp_ms - in_ms:+.2f} ms); channel time attributed per step "
          f"{channel_ms:.3f} ms (scheduler output {executor.last_broadcast_bytes} bytes pickled)")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("tp-overhead", help="per-step cost of the multi-process executor's broadcast (CPU)")
    add_common_args(p)
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--steps", type=positive_int, default=50, help="timed decode steps per round")
    p.add_argument("--rounds", type=positive_int, default=4)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads of the rank (both engines)")
    p.add_argument("--kv-cache-mib", type=positive_int, default=256)
    p.set_defaults(bench_func=main)
