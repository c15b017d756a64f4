"""``tessera bench grpc``: the engine pod's gRPC streaming against the offline engine.

The same workload runs through ``LLM.generate`` in this process and through
a ``tessera engine`` child process, every request a concurrent stream. Also
reports the delay the service adds per streamed token: when the client
receives a response minus when the engine step that made it ended (the
pod's ``timing.last_token_time``; same host, same clock).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import time

from engine_pod import LLM
from engine_pod.server.process import EnginePodProcess
from tessera_tools.bench.common import write_report
from tessera_tools.bench.flags import add_common_args, positive_float, positive_int
from tessera_tools.bench.stats import percentile
from tessera_tools.bench.throughput import run_engine
from tessera_tools.bench.workload import BenchRequest, sharegpt_like
from tessera.internal_channel import InternalClient
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc


async def _stream_all(address: str, requests: list[BenchRequest]) -> tuple[float, int, list[float]]:
    delays: list[float] = []

    async def one(stub, r: BenchRequest) -> int:
        msg = pb.GenerateRequest(
            prompt_token_ids=r.prompt_token_ids,
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
        )
        n = 0
        async for resp in stub.Generate(msg):
            delays.append(time.time() - resp.timing.last_token_time)
            n += len(resp.token_ids)
        return n

    async with InternalClient.from_env().aio_channel(address) as channel:
        stub = pb_grpc.EngineStub(channel)
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(stub, r) for r in requests))
        seconds = time.perf_counter() - start
    return seconds, sum(counts), delays


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of this process, or of another by pid (Linux)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(args: argparse.Namespace) -> int:
    engine_args = ["--dtype", args.dtype, "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)),
                   "--no-prefix-caching"]
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
              enable_prefix_caching=False)
    requests = sharegpt_like(llm.get_tokenizer(), args.num_requests, args.max_prompt_len, args.max_output_len,
                             args.seed)
    expected = sum(r.output_len for r in requests)
    cpu_before = _cpu_seconds()
    offline = run_engine(llm, requests)
    offline_cpu = _cpu_seconds() - cpu_before
    del llm
    gc.collect()
    with EnginePodProcess(args.model, engine_args) as pod:
        pod.wait_serving()
        pod_before, client_before = _cpu_seconds(pod.proc.pid), _cpu_seconds()
        seconds, tokens, delays = asyncio.run(_stream_all(pod.address, requests))
        pod_cpu, client_cpu = _cpu_seconds(pod.proc.pid) - pod_before, _cpu_seconds() - client_before
    if tokens != expected:
        raise RuntimeError(f"gRPC produced {tokens} tokens, expected {expected}")
    grpc_tps = tokens / seconds
    report = {
        "num_requests": len(requests),
        "output_tokens": expected,
        "offline": {"seconds": offline.seconds, "tokens_per_second": offline.tokens_per_second,
                    "cpu_seconds": offline_cpu},
        "grpc": {"seconds": seconds, "tokens_per_second": grpc_tps, "pod_cpu_seconds": pod_cpu,
                 "client_cpu_seconds": client_cpu},
        "grpc_over_offline": grpc_tps / offline.tokens_per_second,
        "added_delay_per_token_ms": {
            "p50": percentile(delays, 50) * 1000,
            "p99": percentile(delays, 99) * 1000,
            "messages": len(delays),
        },
    }
    print(f"offline LLM: {offline.tokens_per_second:.1f} tok/s ({offline.seconds:.1f}s); gRPC streaming: "
          f"{grpc_tps:.1f} tok/s ({seconds:.1f}s) = {report['grpc_over_offline']:.1%} of offline; "
          f"delay added per streamed token p50 {report['added_delay_per_token_ms']['p50']:.2f} ms, "
          f"p99 {report['added_delay_per_token_ms']['p99']:.2f} ms")
    print(f"CPU seconds: offline engine {offline_cpu:.1f}; pod {pod_cpu:.1f}, client {client_cpu:.1f} "
          f"(the client shares this machine's cores with the pod)")
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("grpc", help="engine pod gRPC streaming vs the offline engine")
    add_common_args(p)
    p.add_argument("--num-requests", type=positive_int, default=128)
    p.add_argument("--max-prompt-len", type=positive_int, default=512)
    p.add_argument("--max-output-len", type=positive_int, default=256)
    p.add_argument("--kv-cache-gib", type=positive_float, default=4.0)
    p.set_defaults(bench_func=main)
