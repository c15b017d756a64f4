"""KV sizing and profiling: how many KV blocks a rank can hold, and the
memory figures the per-rank benchmark reads."""

from __future__ import annotations

import logging

import torch

from engine_pod.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine_pod.model.llama import LlamaForCausalLM
from engine_pod.worker.input_batch import build_batch
from engine_pod.worker.kv_cache import allocate_kv_caches, bytes_per_block

logger = logging.getLogger(__name__)


def determine_num_blocks(config: EngineConfig, model: LlamaForCausalLM, device: torch.device, tp_size: int) -> int:
    """An explicit byte budget wins on any device; otherwise CUDA profiles
    and the CPU takes its default budget. Under PP a rank's blocks hold its
    stage's layers only (so the budget gives more of them)."""
    budget = config.cache.kv_cache_memory_bytes
    if budget is None and device.type == "cuda":
        budget = profile_cuda_budget(config, model, device, tp_size)
    elif budget is None:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_layers = len(model.model.stage_layers)
    return int(budget // bytes_per_block(config.model.arch, config.cache.block_size, config.model.dtype, tp_size,
                                         num_layers))


@torch.inference_mode()
def profile_cuda_budget(config: EngineConfig, model: LlamaForCausalLM, device: torch.device, tp_size: int) -> int:
    """Run the largest step the scheduler can produce and give the KV cache
    what remains of the allowed fraction of device memory."""
    sched, arch, block_size = config.scheduler, config.model.arch, config.cache.block_size
    num_tokens = sched.max_num_batched_tokens
    lens = [min(sched.max_model_len, num_tokens - i) for i in range(0, num_tokens, sched.max_model_len)]
    num_blocks = sum(-(-n // block_size) for n in lens)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    stage = model.model
    caches = list(allocate_kv_caches(arch, num_blocks, block_size, config.model.dtype, device, tp_size,
                                     len(stage.stage_layers)))
    block_ids, next_block = [], 0
    for n in lens:
        nb = -(-n // block_size)
        block_ids.append(list(range(next_block, next_block + nb)))
        next_block += nb
    batch = build_batch([[0] * n for n in lens], [0] * len(lens), block_ids, block_size, device)
    intermediate = None
    if not stage.is_first_stage:  # what the previous stage would send: every token's hidden and residual
        shape = (len(batch.input_ids), arch.hidden_size)
        intermediate = tuple(torch.zeros(shape, dtype=config.model.dtype, device=device) for _ in range(2))
    hidden = model(batch.input_ids, batch.positions, caches, batch.metadata, None, intermediate)
    if stage.is_last_stage:
        model.compute_logits(hidden[-min(sched.max_num_seqs, len(hidden)) :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - sum(c.numel() * c.element_size() for c in caches)
    del caches, hidden
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total * config.cache.gpu_memory_utilization - peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={config.cache.gpu_memory_utilization} leaves no memory for the "
            f"KV cache (weights and activations peak at {peak / 2**30:.2f} GiB)"
        )
    logger.info("KV cache budget %.2f GiB after a %.2f GiB profiling peak", budget / 2**30, peak / 2**30)
    return int(budget)


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def resident_memory() -> dict[str, int]:
    """This process's resident and peak resident bytes (Linux), for the
    per-rank memory benchmark."""
    fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out
