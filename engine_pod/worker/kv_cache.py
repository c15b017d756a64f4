"""Sizing and allocating the paged KV cache tensors."""

from __future__ import annotations

import torch

from engine_pod.model.hf_config import ModelArchConfig


def bytes_per_block(cfg: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers: 2 * L * block_size * Hkv * D * bytes."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * element


def allocate_kv_caches(
    cfg: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One [layers, 2, num_blocks, block_size, Hkv, D] tensor (K then V);
    layer l's cache is the contiguous view ``[l]``. One tensor lets the KV
    connector move a block across all layers with a single index_select.

    Zeroed, not empty: attention masks unwritten slots, but a masked NaN
    from uninitialised memory would still poison the weighted sum.
    """
    shape = (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
