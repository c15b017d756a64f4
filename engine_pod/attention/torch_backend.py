"""Paged attention in plain torch: correct on every device, vectorised.

Decodes are one batched SDPA over gathered, length-masked contexts. Prefill
chunks (few per step: the token budget bounds them) are one SDPA each, over
their new tokens alone when nothing is cached before them, else over the
gathered context with a causal mask offset by the cached length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_pod.attention.backend import AttentionBackend, AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[B, nb] block ids -> [B, nb * block_size, Hkv, D] contiguous context."""
    gathered = cache[block_table]
    b, nb, bs, h, d = gathered.shape
    return gathered.view(b, nb * bs, h, d)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        gqa = query.shape[1] != key.shape[1]
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, metadata, scale, gqa)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(nd, len(seq_lens)):
            start, end = int(qsl[i]), int(qsl[i + 1])
            out[start:end] = self._prefill(
                i, query[start:end], key[start:end], value[start:end], kv_cache, metadata, scale, gqa
            )
        return out

    @staticmethod
    def _decode(query, kv_cache, md: AttentionMetadata, scale: float, gqa: bool) -> torch.Tensor:
        nd = md.num_decodes
        max_len = int(md.seq_lens_cpu[:nd].max())
        num_blocks = -(-max_len // md.block_size)
        table = md.block_table[:nd, :num_blocks]
        k = gather_context(kv_cache[0], table).transpose(1, 2)  # [nd, Hkv, L, D]
        v = gather_context(kv_cache[1], table).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=query.device)
        mask = (positions[None, :] < md.seq_lens[:nd, None]).view(nd, 1, 1, -1)
        q = query.unsqueeze(2)  # [nd, Hq, 1, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.squeeze(2)

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
            table = md.block_table[i : i + 1, :num_blocks]
            k = gather_context(kv_cache[0], table)[:, :seq_len].transpose(1, 2)
            v = gather_context(kv_cache[1], table)[:, :seq_len].transpose(1, 2)
            q_pos = torch.arange(num_cached, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.squeeze(0).transpose(0, 1)
