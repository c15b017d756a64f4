"""The torch attention backend against a naive per-sequence reference, on
ragged batches mixing decodes, fresh prefills and prefills over a cached
context, with scattered block tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_pod.attention.backend import AttentionMetadata
from engine_pod.attention.torch_backend import TorchAttentionBackend


def _make_step(seqs, block_size, num_kv_heads, head_dim, num_blocks, gen):
    """seqs: list of (num_cached, num_new); decodes (num_new == 1) must come first."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, next_block = [], [], 0
    for cached, new in seqs:
        nb = -(-(cached + new) // block_size)
        blocks = perm[next_block : next_block + nb]
        next_block += nb
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    width = max(len(t) for t in tables)
    table = np.zeros((len(seqs), width), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    q_lens = np.array([n for _, n in seqs])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens = np.array([c + n for c, n in seqs])
    md = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        num_decodes=int(sum(1 for _, n in seqs if n == 1)),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(table),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return md, tables


def _reference(q, kv_cache, md, tables, scale):
    """Plain softmax attention per sequence in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, blocks in enumerate(tables):
        start, end = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
        seq_len = int(md.seq_lens_cpu[i])
        k = kv_cache[0][blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len].double()
        v = kv_cache[1][blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qi = q[start:end].double()
        scores = torch.einsum("thd,lhd->htl", qi, k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
    return out


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
    md, tables = _make_step(seqs, block_size, num_kv_heads, head_dim, num_blocks, gen)
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
    ref = _reference(q, kv_cache, md, tables, scale)
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()
