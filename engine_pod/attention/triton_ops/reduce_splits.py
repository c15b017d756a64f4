"""The second half of flash-decoding: combine each split's normalised
partial output by the weights exp2(lse_split - max lse)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_splits"])  # changes between steps
def _reduce_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (token * NUM_HEADS + head) * num_splits + splits
    # Splits past a shorter sequence's end hold lse = -inf (weight 0); the
    # first split always holds key 0, so the maximum is finite.
    lse = tl.load(part_lse_ptr + part, mask=splits < num_splits, other=float("-inf"))
    weights = tl.math.exp2(lse - tl.max(lse, 0))
    mask = (splits[:, None] < num_splits) & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def reduce_splits(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out[:n] ([T, Hq, D]) from part_out [n, Hq, splits, D] and part_lse
    [n, Hq, splits], both contiguous float32."""
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    _reduce_splits_kernel[(num_tokens, num_heads)](
        out, part_out, part_lse, num_splits, out.stride(0), out.stride(1),
        # Padded to a power of two: a handful of compiled variants at most.
        NUM_HEADS=num_heads, SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
