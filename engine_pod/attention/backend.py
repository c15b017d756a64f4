"""The attention-backend interface and the metadata every backend reads."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")


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


def get_attention_backend(name: str, device: torch.device, head_size: int, dtype: torch.dtype) -> AttentionBackend:
    """The backend ``name`` asks for on ``device``. auto: triton on CUDA when
    it supports the model (else torch, with a warning), cpu on a CPU when its
    kernels build here (else torch, with a warning); torch: anywhere; triton:
    on CUDA, or on CPU under TRITON_INTERPRET=1; cpu: on a CPU. A backend
    asked for by name that cannot run is a start-up error saying why."""
    from engine_pod.attention.torch_backend import TorchAttentionBackend

    check_backend_name(name)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _cpu_backend(name, device)
    return _triton_backend(name, device, head_size, dtype)


def _cpu_backend(name: str, device: torch.device) -> AttentionBackend:
    from engine_pod.attention.cpu_ops.build import load_cpu_ops
    from engine_pod.attention.torch_backend import TorchAttentionBackend

    reason = f"it runs on CPU engines, this one runs on {device.type}" if device.type != "cpu" else load_cpu_ops()
    if reason is None:
        from engine_pod.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "cpu":
        raise ValueError(f"attention_backend='cpu' cannot run here: {reason}")
    logger.warning("attention_backend=auto: the cpu backend cannot run here (%s); using torch", reason)
    return TorchAttentionBackend()


def _triton_backend(name: str, device: torch.device, head_size: int, dtype: torch.dtype) -> AttentionBackend:
    from engine_pod.attention.torch_backend import TorchAttentionBackend
    from engine_pod.attention.triton_ops.support import triton_unsupported_reason

    reason = triton_unsupported_reason(device, head_size, dtype)
    if reason is None:
        from engine_pod.attention.triton_backend import TritonAttentionBackend, default_split_rule

        return TritonAttentionBackend(default_split_rule(device))
    if name == "triton":
        raise ValueError(f"attention_backend='triton' cannot run here: {reason}")
    logger.warning("attention_backend=auto: the triton backend cannot run this model (%s); using torch", reason)
    return TorchAttentionBackend()


def check_backend_name(name: str) -> None:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: {name!r} is not one of {', '.join(map(repr, ATTENTION_BACKENDS))}")
