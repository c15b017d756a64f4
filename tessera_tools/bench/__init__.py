"""``tessera bench``: benchmarks whose figures go into docs/benchmarks.md."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark")
    kinds = bench.add_subparsers(dest="bench", required=True)
    from tessera_tools.bench import (
        cpu_kernels, fuzz, gateway_overhead, grpc_stream, guided, kernels, kv_store, lora, prefix_cache, profile,
        routing, serve, spec_decode, throughput, tp_memory, tp_overhead,
    )

    throughput.add_parser(kinds)
    prefix_cache.add_parser(kinds)
    grpc_stream.add_parser(kinds)
    kv_store.add_parser(kinds)
    routing.add_parser(kinds)
    gateway_overhead.add_parser(kinds)
    serve.add_parser(kinds)
    tp_overhead.add_parser(kinds)
    tp_memory.add_parser(kinds)
    kernels.add_parser(kinds)
    guided.add_parser(kinds)
    spec_decode.add_parser(kinds)
    lora.add_parser(kinds)
    cpu_kernels.add_parser(kinds)
    fuzz.add_parser(kinds)
    profile.add_parser(kinds)
    from tessera_tools.bench import fleet
    fleet.add_parser(kinds)
    from tessera_tools.bench import pd
    pd.add_parser(kinds)
    from tessera_tools.bench import pp
    pp.add_parser(kinds)
    from tessera_tools.bench import latency
    latency.add_parser(kinds)
    from tessera_tools.bench import quality
    quality.add_parser(kinds)
    bench.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    _ensure_internal_secret()
    return args.bench_func(args)


def _ensure_internal_secret() -> None:
    """Benchmarks start every pod and gateway themselves: without a secret in
    the environment, make one there, for the children to inherit (never an
    argument) and the benchmark's own clients to present."""
    import os

    from tessera.internal_secret import SECRET_ENV, InternalSecret

    if InternalSecret.load() is None:
        os.environ[SECRET_ENV] = InternalSecret.generate().value.decode()
