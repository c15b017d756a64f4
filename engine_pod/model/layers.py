"""Layers of the Llama family that the flattened batch runs through.

With ``cpu_kernels`` a layer runs its element-wise work as one C++ kernel
(attention/cpu_ops/fused_layers.cpp, registered when a CPU engine's kernels
build) instead of a chain of torch operators; the results round where Hugging
Face's do, so both paths give the same tokens.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, cpu_kernels: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.cpu_kernels = cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels:
            out = torch.empty_like(x)
            torch.ops.tessera_cpu.rms_norm(x, self.weight, self.eps, out)
            return out
        # Normalise in float32 like the reference, then cast back before
        # scaling, so every dtype rounds where Hugging Face rounds.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): the residual stream and this norm's
        input. ``x`` is a fresh activation the caller gives up: the kernel
        writes the sum over it."""
        if self.cpu_kernels:
            out = torch.empty_like(x)
            torch.ops.tessera_cpu.add_rms_norm(residual, x, self.weight, self.eps, out)
            return x, out
        total = residual + x
        return total, self(total)


def silu_and_mul(gate_up: torch.Tensor, cpu_kernels: bool) -> torch.Tensor:
    """silu(gate) * up of the rows [gate | up] (HF's Llama MLP activation)."""
    half = gate_up.shape[-1] // 2
    if cpu_kernels:
        out = gate_up.new_empty(gate_up.shape[0], half)
        torch.ops.tessera_cpu.silu_and_mul(gate_up, out)
        return out
    gate, up = gate_up.split(half, dim=-1)
    return nn.functional.silu(gate) * up
