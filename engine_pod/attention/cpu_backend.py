"""Paged attention for CPU engines: the torch backend with its work run by C++
kernels (cpu_ops/).

Decodes: on a CPU a decode step's attention is bound by memory traffic, and
the torch backend copies every decode's blocks into a contiguous tensor per
layer and then reads the copy, three passes over the context's bytes where
one will do; paged_decode.cpp reads K/V straight from the paged cache.

Prefill chunks: torch's CPU SDPA multiplies one query head's small tile at a
time; prefill_attention.cpp stacks the query heads of each KV head and runs
each block of queries as two GEMMs (bf16 dot products into float on AVX-512
BF16, else float32). Where the bf16 GEMMs run and blocks hold whole tiles of
16 positions, all of a step's chunks go in one call (prefill_attention_batch):
each cache block their contexts read is packed once, however many chunks read
it (many requests after one cached prefix), and their work items share the
threads. Otherwise chunk by chunk, a chunk after cached context reading it
from the paged cache through its block table (prefill_attention_paged).
float64 engines keep the torch path (the kernel computes in float32).

The kernels stay the default even where torch's SDPA is faster (bf16 on CPUs
with AMX, whose matrix tiles SDPA's flash kernel uses: 0.3-0.8 of the
kernels' time on fresh chunks, 4% of the bench's throughput): a chunk's
output here does not depend on how the prompt was chunked or how much of it
came from the prefix cache, where SDPA's blocking follows the chunk's length,
and in bf16 that moved greedy tokens at near-ties after a cache hit.
"""

from __future__ import annotations

import torch

from engine_pod.attention.abstract import AttentionMetadata
from engine_pod.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, prefill_kernels: bool = True) -> None:
        self.prefill_kernels = prefill_kernels
        """Prefill chunks on the C++ kernels (True) or on the torch backend's SDPA (False: the
        ablation of `bench throughput --ablate prefill-kernel`)."""

    def _prefill_on_kernels(self, dtype: torch.dtype) -> bool:
        return self.prefill_kernels and dtype != torch.float64

    @staticmethod
    def _decode(query, out, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> None:
        nd = md.num_decodes
        torch.ops.tessera_cpu.paged_decode(
            query[:nd], kv_cache[0], kv_cache[1], md.block_table[:nd], md.seq_lens[:nd], scale, out[:nd]
        )

    def _prefills(self, query, key, value, out, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> None:
        batched = md.backend_cache.get("cpu_prefill_batch")
        if batched is None:
            batched = md.backend_cache["cpu_prefill_batch"] = self._prefill_on_kernels(query.dtype) and bool(
                torch.ops.tessera_cpu.prefill_batch_supported(query, kv_cache[0]))
        if not batched:
            return super()._prefills(query, key, value, out, kv_cache, md, scale, gqa)
        torch.ops.tessera_cpu.prefill_attention_batch(query, kv_cache[0], kv_cache[1], md.block_table,
                                                      md.query_start_loc, md.seq_lens, md.num_decodes, scale, out)

    def _prefill(self, i, q, k_new, v_new, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> torch.Tensor:
        if not self._prefill_on_kernels(q.dtype):
            return TorchAttentionBackend._prefill(i, q, k_new, v_new, kv_cache, md, scale, gqa)
        seq_len = int(md.seq_lens_cpu[i])
        out = torch.empty_like(q)
        if seq_len == q.shape[0]:  # nothing cached before the chunk: its own keys are all there is
            torch.ops.tessera_cpu.prefill_attention(q, k_new, v_new, scale, out)
        else:  # the context (the chunk's own keys already written) read from the cache in place
            torch.ops.tessera_cpu.prefill_attention_paged(q, kv_cache[0], kv_cache[1], md.block_table[i], seq_len,
                                                          scale, out)
        return out
