"""Rotary position embeddings, with the rope scalings of the supported families.

Frequencies and the cos/sin table are computed in float32 exactly as
Hugging Face does, then cast to the model dtype, so positions embed the same
bits as the reference implementation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine_pod.model.rope_config import rope_type_of, validate_rope_scaling

def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original_max = scaling.get("original_max_position_embeddings") or max_position_embeddings
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
    max_model_len: int,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (YaRN's attention factor)."""
    validate_rope_scaling(rope_scaling)
    rope_type = rope_type_of(rope_scaling)
    inv_freq = _default_inv_freq(rope_theta, head_dim)
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rope_theta, head_dim, rope_scaling, max_position_embeddings)
    if rope_type == "dynamic" and max_model_len > max_position_embeddings:
        # Dynamic NTK changes frequencies with the running length; within the
        # trained context it is the default rope, which is all we serve.
        raise ValueError(
            f"rope_scaling: dynamic rope beyond max_position_embeddings ({max_position_embeddings}) "
            f"is not supported; set max_model_len <= {max_position_embeddings}"
        )
    return inv_freq, 1.0


class RotaryEmbedding(torch.nn.Module):
    """Neox-style (rotate-half) rotary embedding over a precomputed table.
    With ``cpu_kernels`` one C++ kernel rotates q and k in place
    (attention/cpu_ops/fused_layers.cpp), rounding where the torch path does."""

    def __init__(
        self, head_dim: int, max_len: int, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype,
        cpu_kernels: bool = False,
    ):
        super().__init__()
        self.cpu_kernels = cpu_kernels
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D]
        if self.cpu_kernels:
            torch.ops.tessera_cpu.rotary_embedding(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
