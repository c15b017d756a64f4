"""``tessera bench gateway``: what the gateway adds to short requests.

One engine pod, one gateway in front of it. The same short requests (token
ids in, a couple of tokens out) go three ways, all streamed:

- direct: the pod's gRPC Engine.Generate, no gateway;
- rest: the gateway's /v1/completions (SSE), with an aiohttp client;
- grpc: the gateway's tessera.v1.Inference/Complete.

Added latency: one request at a time, the three paths interleaved (the
order rotates every round), so machine noise lands on all of them alike.
Sustained rate: a closed-loop concurrency sweep per path, the paths again
interleaved at each level; the highest completed requests/s whose p99
end-to-end latency stays under a bound counts.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tessera_tools.bench.common import markdown_table, resolve_model, rotated, work_dir, write_report
from tessera_tools.bench.flags import (
    add_logs_arg, add_model_args, add_output_arg, add_seed_arg, non_negative_int, positive_float, positive_int,
    positive_int_list,
)
from tessera_tools.bench.stats import percentile
from tessera.internal_channel import InternalClient
from tessera.v1 import engine_pb2 as epb
from tessera.v1 import engine_pb2_grpc as epb_grpc
from tessera.v1 import inference_pb2 as ipb
from tessera.v1 import inference_pb2_grpc as ipb_grpc

MODEL_NAME = "bench"
PATHS = ("direct", "rest", "grpc")


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    e2e_s: float


# A path: token ids in, the request's timing out (raises on failure).
Call = Callable[[list[int]], Awaitable[Timing]]


@dataclass
class Clients:
    """One long-lived connection per path, shared by concurrent calls (as a
    real client would keep them)."""

    pod_address: str
    gateway_url: str
    gateway_grpc: str
    output_len: int
    calls: dict[str, Call] = field(default_factory=dict)

    async def __aenter__(self) -> Clients:
        import aiohttp

        self._pod_channel = InternalClient.from_env().aio_channel(self.pod_address)
        self._gw_channel = grpc.aio.insecure_channel(self.gateway_grpc)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=120))
        engine = epb_grpc.EngineStub(self._pod_channel)
        inference = ipb_grpc.InferenceStub(self._gw_channel)
        self.calls = {"direct": lambda ids: self._direct(engine, ids), "rest": self._rest,
                      "grpc": lambda ids: self._grpc(inference, ids)}
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()
        await self._pod_channel.close()
        await self._gw_channel.close()

    async def _direct(self, stub, ids: list[int]) -> Timing:
        params = epb.SamplingParams(temperature=0.0, max_tokens=self.output_len, ignore_eos=True)
        start, first = time.perf_counter(), None
        async for resp in stub.Generate(epb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)):
            if first is None and resp.token_ids:
                first = time.perf_counter()
        return Timing(first - start, time.perf_counter() - start)

    async def _grpc(self, stub, ids: list[int]) -> Timing:
        params = ipb.GenerationParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=True)
        start, first = time.perf_counter(), None
        async for chunk in stub.Complete(ipb.CompletionRequest(model=MODEL_NAME, prompt_token_ids=ids,
                                                               params=params)):
            if first is None and chunk.choices:
                first = time.perf_counter()
        return Timing(first - start, time.perf_counter() - start)

    async def _rest(self, ids: list[int]) -> Timing:
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": self.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        start, first = time.perf_counter(), None
        async with self._session.post(self.gateway_url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                # An error event is `{"error": ...}`; a chunk whose text is
                # "error" also holds the bytes `"error"`, so look at the key.
                if line.startswith(b'data: {"error"'):
                    raise RuntimeError(line[:200].decode())
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
        return Timing(first - start, time.perf_counter() - start)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 4000) for _ in range(length)]


# -- added latency at low load ----------------------------------------------------
async def measure_latency(clients: Clients, samples: int, prompt_len: int, seed: int) -> dict[str, list[Timing]]:
    """One request at a time; each round sends the same prompt down every
    path, starting with a different path each round."""
    rng = random.Random(seed)
    timings: dict[str, list[Timing]] = {p: [] for p in PATHS}
    for i in range(samples):
        ids = _prompt(rng, prompt_len)
        for path in rotated(PATHS, i):
            timings[path].append(await clients.calls[path](ids))
    return timings


def latency_summary(timings: dict[str, list[Timing]]) -> dict:
    def stats(values: list[float]) -> dict:
        return {"p50_ms": percentile(values, 50) * 1e3, "p99_ms": percentile(values, 99) * 1e3,
                "mean_ms": statistics.mean(values) * 1e3}

    direct = timings["direct"]
    out = {}
    for path, ts in timings.items():
        ttft, e2e = stats([t.ttft_s for t in ts]), stats([t.e2e_s for t in ts])
        entry = {"samples": len(ts), "ttft": ttft, "e2e": e2e}
        if path != "direct":
            base_ttft, base_e2e = stats([t.ttft_s for t in direct]), stats([t.e2e_s for t in direct])
            entry["added"] = {
                "ttft_p50_ms": ttft["p50_ms"] - base_ttft["p50_ms"],
                "ttft_p99_ms": ttft["p99_ms"] - base_ttft["p99_ms"],
                "e2e_p50_ms": e2e["p50_ms"] - base_e2e["p50_ms"],
                "e2e_p99_ms": e2e["p99_ms"] - base_e2e["p99_ms"],
                # Same prompt, same round: the difference cancels slow drifts of the machine.
                "paired_median_e2e_ms": statistics.median(t.e2e_s - d.e2e_s for t, d in zip(ts, direct)) * 1e3,
            }
        out[path] = entry
    return out


# -- sustained rate: closed-loop concurrency sweep -------------------------------
async def closed_loop(call: Call, concurrency: int, seconds: float, prompt_len: int, seed: int) -> dict:
    """`concurrency` workers, each sending its next request when the last
    ends, for `seconds`. Requests started before the deadline all count."""
    rng = random.Random(seed)
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            try:
                latencies.append((await call(_prompt(rng, prompt_len))).e2e_s)
            except Exception as e:  # counted, and the level is not "sustained"
                errors.append(f"{type(e).__name__}: {str(e)[:120]}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "completed": len(latencies), "completed_per_s": len(latencies) / elapsed,
            "p50_e2e_ms": percentile(latencies, 50) * 1e3, "p99_e2e_ms": percentile(latencies, 99) * 1e3,
            "errors": len(errors), "first_errors": errors[:3]}


async def sweep(clients: Clients, levels: list[int], seconds: float, prompt_len: int,
                seed: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {p: [] for p in PATHS}
    for n, level in enumerate(levels):
        for path in rotated(PATHS, n):
            results[path].append(await closed_loop(clients.calls[path], level, seconds, prompt_len, seed + n))
            await asyncio.sleep(0.2)  # let the queues drain between runs
    return results


def max_sustained(levels: list[dict], p99_bound_ms: float) -> dict | None:
    ok = [r for r in levels if r["errors"] == 0 and r["p99_e2e_ms"] <= p99_bound_ms]
    return max(ok, key=lambda r: r["completed_per_s"]) if ok else None


# -- the command ------------------------------------------------------------------
async def _measure(args: argparse.Namespace, pod: EnginePodProcess, gw: GatewayProcess) -> dict:
    levels = args.concurrency
    async with Clients(pod.address, gw.base_url, gw.grpc_address, args.output_len) as clients:
        await measure_latency(clients, args.warmup, args.prompt_len, args.seed + 1)  # discarded
        timings = await measure_latency(clients, args.samples, args.prompt_len, args.seed)
        sweep_results = await sweep(clients, levels, args.sweep_seconds, args.prompt_len, args.seed + 2)
    sustained = {p: max_sustained(sweep_results[p], args.p99_bound_ms) for p in PATHS}
    return {"latency": latency_summary(timings), "sweep": sweep_results, "sustained": sustained}


def _print_summary(report: dict, args: argparse.Namespace) -> None:
    lat = report["latency"]
    print(f"\n{args.prompt_len}-token prompts, {args.output_len} output tokens; one pod ({args.pod_threads} torch "
          f"thread(s)); {args.samples} interleaved samples per path at concurrency 1\n")
    rows = []
    for path in PATHS:
        e, a = lat[path], lat[path].get("added")
        added = [f"{a['ttft_p50_ms']:+.2f} / {a['ttft_p99_ms']:+.2f} ms", f"{a['e2e_p50_ms']:+.2f} / "
                 f"{a['e2e_p99_ms']:+.2f} ms", f"{a['paired_median_e2e_ms']:+.2f} ms"] if a else ["", "", ""]
        rows.append([path, *(f"{e[t][p]:.2f} ms" for t in ("ttft", "e2e") for p in ("p50_ms", "p99_ms")), *added])
    print(markdown_table(("path", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "added TTFT p50 / p99",
                          "added e2e p50 / p99", "added e2e, paired median"), rows))
    print(f"\nClosed-loop sweep ({args.sweep_seconds:g} s per level): completed requests/s (p99 e2e)\n")
    rows = []
    for i, level in enumerate(report["sweep"]["direct"]):
        cells = []
        for path in PATHS:
            r = report["sweep"][path][i]
            cells.append(f"{r['completed_per_s']:.0f}/s ({r['p99_e2e_ms']:.0f} ms)"
                         + (f", {r['errors']} errors" if r["errors"] else ""))
        rows.append([level["concurrency"], *cells])
    print(markdown_table(("concurrency", *PATHS), rows))
    best = report["sustained"]
    direct_rate = best["direct"]["completed_per_s"] if best["direct"] else math.nan
    parts = []
    for path in PATHS:
        b = best[path]
        parts.append(f"{path} {b['completed_per_s']:.0f}/s at concurrency {b['concurrency']} "
                     f"({b['completed_per_s'] / direct_rate:.0%} of direct)" if b else f"{path}: none")
    print(f"\nhighest sustained rate (p99 e2e <= {args.p99_bound_ms:g} ms, no errors): " + "; ".join(parts))
    for path in ("rest", "grpc"):
        print(f"{path}: added at p50 TTFT {lat[path]['added']['ttft_p50_ms']:+.2f} ms, e2e "
              f"{lat[path]['added']['e2e_p50_ms']:+.2f} ms (target < 2 ms)")


def main(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    # One torch thread by default: the pod shares this machine's cores with
    # the gateway and the load generator, and OpenMP threads that spin on a
    # busy core slow everything down.
    with work_dir(args.logs, "tessera-bench-gateway-") as work:
        with EnginePodProcess(model, ["--dtype", args.dtype, "--cpu-threads", str(args.pod_threads)],
                              log_path=work / "pod.log") as pod:
            pod.wait_serving()
            config = {"model": {"name": MODEL_NAME, "path": str(model)},
                      "pods": {"static": [{"address": pod.address, "role": "mixed"}]}}
            with GatewayProcess(config, work, log_path=work / "gateway.log") as gw:
                gw.wait_ready(num_pods=1)
                measured = asyncio.run(_measure(args, pod, gw))
    report = {"model": str(model), "dtype": args.dtype, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "pod_threads": args.pod_threads, "samples": args.samples,
              "sweep_seconds": args.sweep_seconds, "p99_bound_ms": args.p99_bound_ms, **measured}
    _print_summary(report, args)
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("gateway", help="gateway added latency and sustained rate vs the engine pod directly")
    add_model_args(p, default_tiny=True)
    add_seed_arg(p)
    p.add_argument("--prompt-len", type=positive_int, default=8)
    p.add_argument("--output-len", type=positive_int, default=2)
    p.add_argument("--samples", type=positive_int, default=500, help="low-load requests per path")
    p.add_argument("--warmup", type=non_negative_int, default=30, help="discarded low-load requests per path")
    p.add_argument("--concurrency", type=positive_int_list, default="1,2,4,8,16,32,64",
                   help="closed-loop levels, comma-separated")
    p.add_argument("--sweep-seconds", type=positive_float, default=5.0, help="seconds per path and level")
    p.add_argument("--p99-bound-ms", type=positive_float, default=250.0,
                   help="a level counts as sustained while its p99 end-to-end latency stays under this")
    p.add_argument("--pod-threads", type=positive_int, default=1, help="torch threads in the pod (--cpu-threads)")
    add_logs_arg(p)
    add_output_arg(p, default="bench-results/gateway.json")
    p.set_defaults(bench_func=main)
