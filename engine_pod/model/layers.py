"""Layers of the Llama family that the flattened batch runs through."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference, then cast back before
        # scaling, so every dtype rounds where Hugging Face rounds.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class MergedLinear(nn.Module):
    """A linear layer whose output stacks several checkpoint projections
    (q/k/v, or gate/up), so one GEMM replaces several; each source tensor
    is loaded into its own row range."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.empty(offset)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        target = getattr(self, param_name)
        if tensor.shape[0] != size or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(
                f"weight shape {tuple(tensor.shape)} does not fit shard {shard!r} "
                f"({size} rows of {tuple(target.shape[1:])})"
            )
        target.data[offset : offset + size].copy_(tensor)
