"""Attention test cases shared by the backends' tests: a step's metadata over
a scattered block table, and a float64 dense reference per sequence."""

from __future__ import annotations

import numpy as np
import torch

from engine_pod.attention.backend import AttentionMetadata


def make_step(seqs, block_size, num_kv_heads, head_dim, num_blocks, gen):
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


def reference_attention(q, kv_cache, md, tables, scale):
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
