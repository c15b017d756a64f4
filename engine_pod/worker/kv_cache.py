"""Sizing and allocating the paged KV cache tensors (of one rank).

Under pipeline parallelism a rank caches its stage's layers only
(``num_layers``), so the same byte budget holds more blocks."""

from __future__ import annotations

import torch

from engine_pod.model.hf_config import ModelArchConfig
from engine_pod.model.parallel_layers import kv_heads_per_rank
from engine_pod.worker.cpu_malloc import advise_huge_pages


def bytes_per_block(
    cfg: ModelArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1, num_layers: int | None = None
) -> int:
    """K and V of one block across the rank's layers (``num_layers``, None:
    all): 2 * L * block_size * Hkv_rank * D * bytes."""
    element = torch.empty((), dtype=dtype).element_size()
    heads = kv_heads_per_rank(cfg.num_key_value_heads, tp_size)
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * block_size * heads * cfg.head_dim * element


def allocate_kv_caches(
    cfg: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    tp_size: int = 1, num_layers: int | None = None,
) -> torch.Tensor:
    """One [layers, 2, num_blocks, block_size, Hkv_rank, D] tensor (K then V),
    for the rank's ``num_layers`` (None: all of the model's);
    layer l's cache is the contiguous view ``[l]``. One tensor lets the KV
    connector move a block across all layers with a single index_select.

    Zeroed, not empty: attention masks unwritten slots, but a masked NaN
    from uninitialised memory would still poison the weighted sum. On a CPU
    the memory is advised to huge pages before it is zeroed (cpu_malloc).
    """
    heads = kv_heads_per_rank(cfg.num_key_value_heads, tp_size)
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    shape = (layers, 2, num_blocks, block_size, heads, cfg.head_dim)
    cache = torch.empty(shape, dtype=dtype, device=device)
    if cache.device.type == "cpu":
        advise_huge_pages(cache)
    return cache.zero_()
