"""Engine flags shared by every command that builds an engine."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="fixed KV pool size in blocks")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV budget in bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of create_engine_config (and LLM) from the flags."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
    )
