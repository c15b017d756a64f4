"""The attention-backend interface and the metadata every backend reads
(the selector, selector.py, picks one of the backends that implement it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened step: B sequences, T tokens.

    Sequences with exactly one query token (decodes) come first, so backends
    can treat ``[:num_decodes]`` as a batched decode.
    """

    num_actual_tokens: int
    num_decodes: int
    # [T] flat slot index (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # [B + 1] cumulative query lengths.
    query_start_loc: torch.Tensor
    # [B] context length after this step (computed before + scheduled now).
    seq_lens: torch.Tensor
    # [B, max_blocks] physical block ids.
    block_table: torch.Tensor
    # Host copies, so backends can size work without a device sync.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    block_size: int
    # Per-step scratch a backend may fill on the first layer and reuse in the
    # others (index plans, masks), so per-layer work stays minimal.
    backend_cache: dict = field(default_factory=dict)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write key/value ([T, Hkv, D]) into ``kv_cache`` ([2, num_blocks,
        block_size, Hkv, D]) and return causal attention of query ([T, Hq, D])
        over each sequence's whole context, as [T, Hq, D]."""
