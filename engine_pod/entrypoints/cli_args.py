"""Engine flags shared by every command that builds an engine.

A flag whose value lands in a config dataclass takes its default from that
field (engine_pod/config.py), so the flags, LLM(...) and create_engine_config
agree by construction (tests/engine_pod/test_cli_defaults.py).
"""

from __future__ import annotations

import argparse
import os

from engine_pod.attention.selector import ATTENTION_BACKENDS
from engine_pod.config import (
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    NodeLayout,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
)
from engine_pod.lora.config import LoRAConfig
from kv_store.redis_tier import REDIS_URL_ENV


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    cache, sched, kv = CacheConfig, SchedulerConfig, KVStoreConfig
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint folder, or a GGUF file (converted once into "
                   "$TESSERA_GGUF_CACHE, default ~/.cache/tessera/gguf)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=cache.block_size)
    g.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)
    g.add_argument("--long-prefill-token-threshold", type=int, default=sched.long_prefill_token_threshold)
    g.add_argument("--num-gpu-blocks", type=int, default=cache.num_gpu_blocks, help="fixed KV pool size in blocks")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=cache.kv_cache_memory_bytes,
                   help="KV budget in bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=cache.gpu_memory_utilization)
    # Prefix caching is on by default (CacheConfig.enable_prefix_caching): the flag turns it off.
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--scheduling-policy", default=sched.policy.value, choices=[p.value for p in SchedulingPolicy])
    g.add_argument("--background-priority", type=int, default=sched.background_priority,
                   help="requests of this priority or above (batch jobs) run only on capacity the others leave "
                        "idle: nothing while another request waits or prefills (needs --scheduling-policy priority)")
    g.add_argument("--background-max-batched-tokens", type=int, default=sched.background_max_batched_tokens,
                   help="tokens background requests take in one step at most, all together")
    g.add_argument("--attention-backend", default=EngineConfig.attention_backend, choices=ATTENTION_BACKENDS,
                   help="auto: triton on CUDA when it supports the model, else torch; triton on CPU needs "
                        "TRITON_INTERPRET=1 (slow, for tests)")
    g.add_argument("--tensor-parallel-size", type=int, default=ParallelConfig.tensor_parallel_size,
                   help="ranks to split the model across, one worker process each (gloo on CPU, nccl on CUDA)")
    g.add_argument("--pipeline-parallel-size", type=int, default=ParallelConfig.pipeline_parallel_size,
                   help="pipeline stages to split the layers across, each of --tensor-parallel-size ranks "
                        "(one worker process per rank; up to one step per stage in flight)")
    g.add_argument("--speculative-config", default=EngineConfig.speculative,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\'')
    lo = parser.add_argument_group("LoRA adapters")
    lo.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT layout) on the base model")
    lo.add_argument("--max-loras", type=int, default=LoRAConfig.max_loras,
                    help="adapters one step may mix (their weights in the model's slots at once)")
    lo.add_argument("--max-lora-rank", type=int, default=LoRAConfig.max_lora_rank,
                    help="the largest adapter rank accepted; sizes the slots")
    lo.add_argument("--max-cpu-loras", type=int, default=LoRAConfig.max_cpu_loras,
                    help="adapters kept in host memory (default: --max-loras)")
    k = parser.add_argument_group("KV store")
    k.add_argument("--kv-host-bytes", type=int, default=kv.host_bytes, help="host-memory tier budget in bytes (0: off)")
    k.add_argument("--kv-redis-url", default=kv.redis_url,
                   help=f"redis:// or rediss:// URL of the shared tier (default: ${REDIS_URL_ENV}; prefer the "
                        "variable when the URL holds a password: the command line is visible to every user)")
    k.add_argument("--kv-redis-ttl", type=int, default=kv.redis_ttl_seconds, help="seconds a block lives in Redis")
    k.add_argument("--kv-redis-cluster", action="store_true", help="the URL names a Redis Cluster")
    k.add_argument("--kv-redis-key-prefix", default=kv.redis_key_prefix,
                   help="prefix of every Redis key (one per InferenceService, for a Redis ACL)")
    k.add_argument("--kv-redis-ca-file", default=kv.redis_ca_file,
                   help="rediss://: CA bundle that signs the server's certificate")
    k.add_argument("--kv-redis-cert-file", default=kv.redis_cert_file, help="rediss://: client certificate (PEM)")
    k.add_argument("--kv-redis-key-file", default=kv.redis_key_file,
                   help="rediss://: the client certificate's private key (PEM)")
    k.add_argument("--kv-redis-timeout", type=float, default=kv.redis_timeout_seconds,
                   help="seconds each Redis call may take; a slower one is a miss (the blocks are recomputed)")
    k.add_argument("--kv-write-queue-size", type=int, default=kv.write_queue_size,
                   help="Redis write-behind queue; beyond it writes are dropped (and counted)")
    k.add_argument("--kv-inbox-bytes", type=int, default=kv.inbox_bytes,
                   help="decode pods: budget in bytes of the blocks prefill pods push here over the direct P/D "
                        "channel (0: none taken; requests read Redis)")
    k.add_argument("--kv-direct-timeout", type=float, default=kv.direct_timeout_s,
                   help="prefill pods: seconds one direct push may take before its blocks go to Redis instead")


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
        background_priority=args.background_priority,
        background_max_batched_tokens=args.background_max_batched_tokens,
        attention_backend=args.attention_backend,
        kv_host_bytes=args.kv_host_bytes,
        kv_redis_url=args.kv_redis_url or os.environ.get(REDIS_URL_ENV) or None,
        kv_redis_ttl=args.kv_redis_ttl,
        kv_redis_cluster=args.kv_redis_cluster,
        kv_write_queue_size=args.kv_write_queue_size,
        kv_redis_key_prefix=args.kv_redis_key_prefix,
        kv_redis_ca_file=args.kv_redis_ca_file,
        kv_redis_cert_file=args.kv_redis_cert_file,
        kv_redis_key_file=args.kv_redis_key_file,
        kv_redis_timeout=args.kv_redis_timeout,
        kv_inbox_bytes=args.kv_inbox_bytes,
        kv_direct_timeout_s=args.kv_direct_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """The pod's multi-node flags (`tessera engine`): where its ranks sit
    among the engine's nodes. Process-level: they land in
    ParallelConfig.nodes (NodeLayout), not in create_engine_config's kwargs."""
    n = parser.add_argument_group("multi-node (one engine's ranks over several pods)")
    n.add_argument("--nnodes", type=int, default=NodeLayout.nnodes,
                   help="processes (pods) the pipeline x tensor parallel ranks span; node k hosts ranks "
                        "[k*W/N, (k+1)*W/N) of the W in all (with N = pipeline size: one stage per node)")
    n.add_argument("--node-rank", type=int, default=NodeLayout.node_rank,
                   help="this process's node: 0 is the leader (engine core, gRPC server); above 0 runs only its "
                        "ranks and exits non-zero when the group fails")
    n.add_argument("--master-addr", default=NodeLayout.master_addr,
                   help="the leader's address the other nodes dial (required with --nnodes > 1); the nodes "
                        "authenticate with the internal secret (environment, never argv)")
    n.add_argument("--master-port", type=int, default=NodeLayout.master_port,
                   help="the leader's rendezvous port (torch.distributed TCPStore); the node control channel "
                        "takes the next one (master-port + 1)")


def node_layout(args: argparse.Namespace) -> NodeLayout:
    """The NodeLayout of the flags (ValueError naming the bad one)."""
    return NodeLayout(args.nnodes, args.node_rank, args.master_addr, args.master_port)
