"""Paged attention in plain torch: correct on every device, vectorised.

Decodes (one query token each) run as batched SDPA calls over gathered,
length-masked contexts. Sequences are sorted by context length and taken in
groups of ``DECODE_GROUP`` so each group pads only to its own longest
context: a long-tailed batch would otherwise gather and attend over
``batch x longest`` slots. Prefill chunks (few per step: the token budget
bounds them) are one SDPA each, over their new tokens alone when nothing is
cached before them, else over the gathered context with a causal mask offset
by the cached length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine_pod.attention.abstract import AttentionBackend, AttentionMetadata

DECODE_GROUP = 8


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, flat_block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Copy whole blocks (rows of block_size * Hkv * D) into a
    [num_seqs, blocks_per_seq * block_size, Hkv, D] context tensor."""
    num_blocks, block_size, heads, dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, flat_block_ids)
    return rows.view(num_seqs, -1, heads, dim)


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # indices into the decode batch
    flat_block_ids: torch.Tensor  # [len(rows) * num_blocks]
    mask: torch.Tensor  # [len(rows), 1, 1, num_blocks * block_size]


def _plan_decode_groups(md: AttentionMetadata) -> list[_DecodeGroup]:
    """Built once per step from host copies and shared by every layer."""
    nd, bs = md.num_decodes, md.block_size
    lens = md.seq_lens_cpu[:nd]
    order = np.argsort(lens, kind="stable")
    device = md.block_table.device
    groups = []
    for start in range(0, nd, DECODE_GROUP):
        rows = order[start : start + DECODE_GROUP]
        num_blocks = -(-int(lens[rows].max()) // bs)
        rows_t = torch.from_numpy(rows).to(device, non_blocking=True)
        table = md.block_table.index_select(0, rows_t)[:, :num_blocks]
        positions = torch.arange(num_blocks * bs, device=device)
        seq_lens = torch.from_numpy(lens[rows]).to(device, non_blocking=True)
        mask = (positions[None, :] < seq_lens[:, None]).view(len(rows), 1, 1, -1)
        groups.append(_DecodeGroup(rows_t, table.reshape(-1), mask))
    return groups


# SDPA's single-query path is fastest in full precision; in bf16/fp16 its CPU
# kernel was 5x slower than explicit matmuls (measured on the bench model's
# shapes), so half precision takes the matmul path with a float32 softmax.
_SDPA_DECODE_DTYPES = (torch.float32, torch.float64)


def _sdpa_decode_group(q, k, v, mask, scale: float, gqa: bool) -> torch.Tensor:
    """q [n, Hq, D]; k, v [n, L, Hkv, D] -> [n, Hq, D]."""
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    return o.squeeze(2)


def _matmul_decode_group(q, k, v, mask, scale: float, gqa: bool) -> torch.Tensor:
    """Grouped-query decode as two batched matmuls: the Hq / Hkv query heads
    that share a KV head form the rows of one matmul, so K/V are never
    repeated per query head."""
    n, num_heads, dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    k = k.permute(0, 2, 1, 3).contiguous()  # [n, Hkv, L, D]
    v = v.permute(0, 2, 1, 3).contiguous()
    scores = torch.matmul(q.view(n, num_kv_heads, group, dim), k.transpose(-1, -2)).float() * scale
    scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(n, num_heads, dim)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        gqa = query.shape[1] != key.shape[1]
        nd = metadata.num_decodes
        if nd:
            self._decode(query, out, kv_cache, metadata, scale, gqa)
        if nd < len(metadata.seq_lens_cpu):
            self._prefills(query, key, value, out, kv_cache, metadata, scale, gqa)
        return out

    def _prefills(self, query, key, value, out, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> None:
        """Every prefill chunk of the step (sequences num_decodes ..), one at a time."""
        qsl = md.query_start_loc_cpu
        for i in range(md.num_decodes, len(md.seq_lens_cpu)):
            start, end = int(qsl[i]), int(qsl[i + 1])
            out[start:end] = self._prefill(i, query[start:end], key[start:end], value[start:end], kv_cache, md, scale,
                                           gqa)

    @staticmethod
    def _decode(query, out, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> None:
        groups = md.backend_cache.get("torch_decode_groups")
        if groups is None:
            groups = md.backend_cache["torch_decode_groups"] = _plan_decode_groups(md)
        decode_group = _sdpa_decode_group if query.dtype in _SDPA_DECODE_DTYPES else _matmul_decode_group
        for g in groups:
            n = len(g.rows)
            k = gather_blocks(kv_cache[0], g.flat_block_ids, n)  # [n, L, Hkv, D]
            v = gather_blocks(kv_cache[1], g.flat_block_ids, n)
            o = decode_group(query.index_select(0, g.rows), k, v, g.mask, scale, gqa)
            out.index_copy_(0, g.rows, o)

    @staticmethod
    def _prefill(i, q, k_new, v_new, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> torch.Tensor:
        num_new = q.shape[0]
        seq_len = int(md.seq_lens_cpu[i])
        num_cached = seq_len - num_new
        q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if num_cached == 0:
            k = k_new.transpose(0, 1).unsqueeze(0)
            v = v_new.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            num_blocks = -(-seq_len // md.block_size)
            blocks = md.block_table[i, :num_blocks]
            k = gather_blocks(kv_cache[0], blocks, 1)[:, :seq_len].transpose(1, 2)
            v = gather_blocks(kv_cache[1], blocks, 1)[:, :seq_len].transpose(1, 2)
            q_pos = torch.arange(num_cached, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.squeeze(0).transpose(0, 1)
