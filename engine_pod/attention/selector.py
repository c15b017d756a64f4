"""Choosing the attention backend an engine runs (``attention_backend``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Only the chosen backend needs torch: a simulated engine checks the name alone.
    import torch

    from engine_pod.attention.abstract import AttentionBackend

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")


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
