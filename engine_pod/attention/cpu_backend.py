"""Paged attention for CPU engines: the torch backend with its decodes run by
a C++ kernel (cpu_ops/paged_decode.cpp) that reads K/V straight from the
paged cache.

On a CPU, a decode step's attention is bound by memory traffic: the torch
backend copies every decode's blocks into a contiguous tensor per layer and
then reads the copy, three passes over the context's bytes where one will
do. Prefill chunks stay on the torch path: they are GEMM-shaped, and SDPA
does them well.
"""

from __future__ import annotations

import torch

from engine_pod.attention.abstract import AttentionMetadata
from engine_pod.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @staticmethod
    def _decode(query, out, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> None:
        nd = md.num_decodes
        torch.ops.tessera_cpu.paged_decode(
            query[:nd], kv_cache[0], kv_cache[1], md.block_table[:nd], md.seq_lens[:nd], scale, out[:nd]
        )
