"""The torch attention backend against a naive per-sequence reference, on
ragged batches mixing decodes, fresh prefills and prefills over a cached
context, with scattered block tables."""

from __future__ import annotations

import pytest
import torch

from engine_pod.attention.torch_backend import TorchAttentionBackend
from tessera_tools.fixtures.attention_cases import make_step, reference_attention


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_matches_reference(dtype, tol, num_heads, num_kv_heads, block_size):
    gen = torch.Generator().manual_seed(block_size * 100 + num_heads * 10 + num_kv_heads)
    head_dim, num_blocks = 64, 256
    # 11 decodes of assorted lengths (more than one decode group), then a
    # fresh prefill, a prefill over a cached prefix ending mid-block, and one
    # ending on a block boundary.
    decodes = [(c, 1) for c in (0, 1, 7, 8, 15, 16, 17, 40, 63, 100, 129)]
    seqs = decodes + [(0, 13), (21, 9), (2 * block_size, block_size)]
    md, tables = make_step(seqs, block_size, num_kv_heads, head_dim, num_blocks, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    T = md.num_actual_tokens
    q = torch.randn(T, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = TorchAttentionBackend().forward(q, k, v, kv_cache, md, scale)
    # The backend wrote the new K/V into the cache; the reference reads it back.
    flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[md.slot_mapping], k)
    ref = reference_attention(q, kv_cache, md, tables, scale)
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()
