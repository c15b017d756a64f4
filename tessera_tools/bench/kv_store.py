"""``tessera bench kv-store``: TTFT of a long prompt by recomputation vs from
the host tier vs from Redis, the Redis tier's read throughput next to
redis-benchmark's for the same value size (plus one-block vs run-of-blocks
keys, the measurement behind the one-block-per-key choice), and the codec's
cost per block (encode, the MAC on signing and on verification)."""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from engine_pod import LLM, SamplingParams
from kv_store.codec import BlockCodec, BlockLayout
from kv_store.local_redis import RedisServer
from kv_store.redis_tier import RedisTier, RedisTierConfig
from tessera_tools.bench.common import write_report
from tessera_tools.bench.flags import add_common_args, int_at_least, positive_float, positive_int
from tessera_tools.bench.stats import best_of
from tessera.internal_secret import InternalSecret


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1))[0]
    return time.perf_counter() - start, out.num_cached_tokens


def _forget_device_cache(llm: LLM) -> None:
    if not llm.engine_core.scheduler.kv_cache_manager.reset_prefix_cache():
        raise RuntimeError("prefix cache still in use")


def _ttft_runs(args, redis_url: str) -> tuple[dict, BlockLayout]:
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), max_model_len=args.prompt_len)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(5, 6000) for _ in range(args.prompt_len)] for _ in range(args.repeats)]
    # The environment's secret when there is one, else a fresh one: the
    # writer and the reader must share it (one deployment).
    common["kv_mac_key"] = (InternalSecret.load() or InternalSecret.generate()).kv_mac_key
    writer = LLM(args.model, **common, kv_host_bytes=int(args.host_gib * 2**30), kv_redis_url=redis_url)
    _ttft(writer, [5] * 64)  # warm-up
    recompute, host = [], []
    for p in prompts:
        recompute.append(_ttft(writer, p))  # computes, saves to both tiers
        writer.engine_core.kv_store.flush(timeout=60)  # no Redis writes competing with the next run
        _forget_device_cache(writer)
        host.append(_ttft(writer, p))  # device cache empty, host tier warm
    writer.engine_core.kv_store.flush(timeout=60)
    reader = LLM(args.model, **common, kv_redis_url=redis_url)  # empty device cache, no host tier
    _ttft(reader, [6] * 64)
    redis = [_ttft(reader, p) for p in prompts]
    result = {}
    for name, runs in (("recompute", recompute), ("host_tier", host), ("redis", redis)):
        result[name] = {"median_ttft_s": statistics.median(t for t, _ in runs),
                        "cached_tokens": [c for _, c in runs]}
    for name in ("host_tier", "redis"):
        result[name]["speedup_vs_recompute"] = result["recompute"]["median_ttft_s"] / result[name]["median_ttft_s"]
    layout = writer.engine_core.kv_store.codec.layout
    result["block_bytes"] = len(writer.engine_core.kv_store.codec.encode(b"\0" * 32, bytes(layout.payload_bytes)))
    return result, layout


# A 2 MiB block: Llama-3-8B's shape (32 layers, 8 KV heads of 128, bf16, 16 tokens).
_LARGE_LAYOUT = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128)


def _codec_costs(layout: BlockLayout, repeats: int) -> dict:
    """Milliseconds per block of each codec step (best of ``repeats``): the
    host tier's encode and decode, and the MAC's share on the Redis path
    (sign on the write-behind thread, verification on the engine step).
    Encode and decode include the tensor's conversion, as the engine's worker does it."""
    import torch

    from kv_store.tensor_codec import block_payload, payload_block, torch_dtype

    codec = BlockCodec(layout, InternalSecret.generate().kv_mac_key)
    block = torch.randn(layout.block_shape).to(torch_dtype(layout))
    h = b"\1" * 32
    value = codec.encode(h, block_payload(layout, block))
    signed = codec.sign(value)
    steps = {
        "encode_ms": lambda: codec.encode(h, block_payload(layout, block)),
        "sign_ms": lambda: codec.sign(value),
        "decode_host_ms": lambda: payload_block(layout, codec.decode(h, value, verify_mac=False)),
        "decode_verified_ms": lambda: payload_block(layout, codec.decode(h, signed)),
    }
    out = {"block_bytes": len(signed)}
    for name, step in steps.items():
        out[name] = best_of(step, repeats) * 1000
    out["mac_gb_s"] = len(signed) / ((out["decode_verified_ms"] - out["decode_host_ms"]) / 1000) / 1e9
    return out


def _tier_read_throughput(url: str, value_bytes: int, batch: int, total_bytes: int, run_blocks: int) -> dict:
    """GB/s of RedisTier.get_many over one-block keys, and over keys that
    each hold ``run_blocks`` blocks (the alternative unit)."""
    tier = RedisTier(RedisTierConfig(url, timeout_seconds=5.0), namespace="bench:")
    value = random.Random(0).randbytes(value_bytes)
    n = max(batch, total_bytes // value_bytes)
    keys = [i.to_bytes(32, "little") for i in range(n)]
    for i in range(0, n, batch):
        tier.put_many([(k, value) for k in keys[i : i + batch]])
    start = time.perf_counter()
    got = 0
    for i in range(0, n, batch):
        got += sum(len(v) for v in tier.get_many(keys[i : i + batch]) if v)
    one_block = got / (time.perf_counter() - start) / 1e9
    run_value = value * run_blocks
    run_keys = [(i + n).to_bytes(32, "little") for i in range(n // run_blocks)]
    tier.put_many([(k, run_value) for k in run_keys])
    start = time.perf_counter()
    got = 0
    per_batch = max(1, batch // run_blocks)
    for i in range(0, len(run_keys), per_batch):
        got += sum(len(v) for v in tier.get_many(run_keys[i : i + per_batch]) if v)
    runs = got / (time.perf_counter() - start) / 1e9
    tier.close()
    return {"one_block_per_key_gb_s": one_block, f"{run_blocks}_blocks_per_key_gb_s": runs, "batch_blocks": batch}


def _redis_benchmark(port: int, value_bytes: int, requests: int, pipeline: int) -> float | None:
    """GB/s of GETs of value_bytes values by redis-benchmark (1 client, pipelined)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    out = subprocess.run(
        [binary, "-p", str(port), "-t", "set,get", "-d", str(value_bytes), "-n", str(requests), "-c", "1",
         "-P", str(pipeline), "--csv", "-q"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    for line in out.splitlines():
        fields = [f.strip('"') for f in line.split(",")]
        if fields and fields[0] == "GET":
            return float(fields[1]) * value_bytes / 1e9
    return None


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            ttft, layout = _ttft_runs(args, server.url)
            report = {"ttft": ttft}
            t = report["ttft"]
            print(f"TTFT of a {args.prompt_len}-token prompt (median of {args.repeats}): recompute "
                  f"{t['recompute']['median_ttft_s'] * 1000:.0f} ms; "
                  f"host tier {t['host_tier']['median_ttft_s'] * 1000:.0f} ms "
                  f"({t['host_tier']['speedup_vs_recompute']:.1f}x); Redis {t['redis']['median_ttft_s'] * 1000:.0f} ms "
                  f"({t['redis']['speedup_vs_recompute']:.1f}x)")
            large = BlockLayout(**{**layout.__dict__, **_LARGE_LAYOUT})
            report["codec"] = {"engine_block": _codec_costs(layout, 50), "2mib_block": _codec_costs(large, 20)}
            for name, c in report["codec"].items():
                print(f"codec, {name} of {c['block_bytes']} bytes: encode {c['encode_ms']:.3f} ms, sign "
                      f"{c['sign_ms']:.3f} ms, decode from the host tier {c['decode_host_ms']:.3f} ms, decode with "
                      f"the MAC verified {c['decode_verified_ms']:.3f} ms (MAC {c['mac_gb_s']:.2f} GB/s)")
            value_bytes = t["block_bytes"]
            batch = (args.prompt_len - 1) // 16
            # Alternate the tier and redis-benchmark over rounds: the machine's
            # noise is larger than one run can average out.
            rounds = []
            for _ in range(args.read_rounds):
                server.client.flushall()
                tier = _tier_read_throughput(server.url, value_bytes, batch, args.read_mib << 20, args.run_blocks)
                server.client.flushall()
                requests = max(200, (args.read_mib << 20) // value_bytes)
                bench = _redis_benchmark(server.port, value_bytes, requests, batch)
                rounds.append({**tier, "redis_benchmark_get_gb_s": bench})
            one = statistics.median(r["one_block_per_key_gb_s"] for r in rounds)
            run = statistics.median(r[f"{args.run_blocks}_blocks_per_key_gb_s"] for r in rounds)
            ratios = [r["one_block_per_key_gb_s"] / r["redis_benchmark_get_gb_s"] for r in rounds
                      if r["redis_benchmark_get_gb_s"]]
            report["redis_read"] = {"value_bytes": value_bytes, "batch_blocks": batch, "rounds": rounds,
                                    "median_one_block_per_key_gb_s": one, "median_run_per_key_gb_s": run,
                                    "tier_over_redis_benchmark": ratios}
            print(f"Redis reads of {value_bytes}-byte blocks, {batch} per round trip, median of {len(rounds)} rounds: "
                  f"tier {one:.2f} GB/s (one block per key), {run:.2f} GB/s ({args.run_blocks} blocks per key); "
                  f"tier / redis-benchmark GET -P {batch} per round: {', '.join(f'{x:.0%}' for x in ratios)} "
                  f"(median {statistics.median(ratios) if ratios else float('nan'):.0%})")
        finally:
            server.stop()
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("kv-store", help="TTFT from the KV store tiers; Redis tier read throughput")
    add_common_args(p)
    # Room for the 64-token warm-up prompt (the context is --prompt-len),
    # and so at least one block per round trip of the read test.
    p.add_argument("--prompt-len", type=int_at_least(64), default=2048)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--kv-cache-gib", type=positive_float, default=2.0)
    p.add_argument("--host-gib", type=positive_float, default=2.0)
    p.add_argument("--read-mib", type=positive_int, default=512, help="MiB read per round of the throughput test")
    p.add_argument("--run-blocks", type=positive_int, default=8, help="blocks per key for the alternative unit")
    p.add_argument("--read-rounds", type=positive_int, default=5)
    p.set_defaults(bench_func=main)
