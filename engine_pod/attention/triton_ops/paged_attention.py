"""Causal attention over the paged KV cache for a flattened batch.

One program computes one query tile (``BLOCK_Q`` tokens of one sequence)
for one KV head: the rows of its tile are those tokens times the query heads
of the KV head's GQA group, so each K/V tile is loaded once for the whole
group. It walks the sequence's block table ``TILE_N`` keys at a time with an
online softmax in float32 (base 2: ``exp2`` of scores pre-scaled by log2 e),
masking keys past each row's own position, which is the cached length plus
the row's index among the new tokens.

With ``SPLIT`` (decodes with long contexts) axis 2 of the grid splits the
keys into ``num_splits`` ranges of ``split_len``; each program then writes
its normalised partial output and log-sum-exp for ``reduce_splits`` to
combine. The split count is a runtime argument, not a compile-time one, so
the count changing from step to step compiles nothing new.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine_pod.attention.triton_ops.plan import KernelShape, LaunchPlan

LOG2_E = 1.0 / math.log(2.0)


# Triton specialises integer arguments on their value (== 1, divisible by 16);
# these change from step to step, and specialising on them would compile
# new variants mid-serving.
@triton.jit(do_not_specialize=["num_splits", "split_len", "stride_bt"])
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr, tile_seq_ptr, tile_q_start_ptr,
    scale_log2, num_splits, split_len, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_tile_start = tl.load(tile_q_start_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_tile_start + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (q_tok < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = (q_start + q_tok).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = num_cached + q_tok

    # Keys [kv_start, kv_end): up to the last row's position, within the split.
    kv_end = tl.minimum(num_cached + q_tile_start + BLOCK_Q, seq_len)
    kv_start = 0
    if SPLIT:
        kv_start = split * split_len
        kv_end = tl.minimum(kv_end, kv_start + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, TILE_N):
        keys = start + tl.arange(0, TILE_N)
        key_valid = keys < kv_end
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = block * stride_c_block + (keys % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
        k_mask = key_valid[None, :] & dim_valid[:, None]
        k = tl.load(k_cache_ptr + slot[None, :] + dims[:, None], mask=k_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(key_valid[None, :] & (keys[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet (a padding row) keeps
        # m = -inf: shift it by 0 so exp2 yields 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = key_valid[:, None] & dim_valid[None, :]
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=v_mask, other=0.0)
        # P is rounded to the cache dtype for the second product, as on the GPU.
        p = p.to(v_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # l = 0 only where a row saw no key: padding rows, or splits past the end.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if not SPLIT:
        out = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (token * num_heads + head) * num_splits + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_q_start: torch.Tensor,
    plan: LaunchPlan,
    scale: float,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention of ``query`` [T, Hq, D] into ``out`` (or, for a split
    launch, into ``partials``: out [T, Hq, splits, D] and lse [T, Hq, splits]
    in float32) for the tiles of ``plan``."""
    _, num_heads, head_dim = query.shape
    shape = KernelShape(num_heads, kv_cache.shape[3], head_dim)
    part_out, part_lse = partials if partials is not None else (out, out)
    cfg = plan.config
    grid = (len(plan.tile_seq), shape.num_kv_heads, plan.num_splits)
    _paged_attention_kernel[grid](
        out, part_out, part_lse,
        query, kv_cache[0], kv_cache[1],
        block_table, seq_lens, query_start_loc, tile_seq, tile_q_start,
        scale * LOG2_E, plan.num_splits, plan.split_len, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        BLOCK_SIZE=kv_cache.shape[2], GROUP=shape.group, GROUP_PAD=shape.group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_Q=plan.block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n,
        SPLIT=plan.num_splits > 1, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # The interpreter (the only way these kernels see CPU tensors)
        # multiplies bfloat16 tiles wrongly in tl.dot; float32 tiles holding
        # the same bfloat16 values give the GPU's products.
        UPCAST_DOT=query.device.type == "cpu" and query.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
