"""Batched multi-LoRA products on the GPU (vLLM's punica "shrink" and
"expand", written for this engine): ``out[t] += scaling[s] * (x[t] A[s]^T) B[s]^T``
for every token ``t`` whose adapter slot ``s`` is not -1.

Tokens of one batch use different adapters, while a matrix product wants one
weight matrix per tile. So the tokens are first grouped by slot (a stable
sort of the slot indices; ``group_tokens_by_slot``), and each program of a
kernel handles ``BLOCK_T`` consecutive tokens of *one* slot: it gathers their
rows of ``x``/``out`` through the sorted order and multiplies them by that
slot's factors with ``tl.dot``. The grid has a column per slot; a program
whose tile starts past its slot's token count returns at once, so the work
is proportional to the tokens, not to tokens x slots. Tokens of slot -1 sort
before slot 0 and belong to no program: their rows of ``out`` are never
read or written.

- shrink: ``buf[i] = x[order[i]] @ A[s]^T`` in the compute dtype (float32,
  float64 for a float64 model), for a rank tile of ``BLOCK_R`` columns per
  program (axis 2 of the grid), looping over ``in_features`` ``BLOCK_K`` at
  a time.
- expand: ``out[order[i]] = (out[order[i]] + (buf[i] @ B[s]^T) * scaling[s])``
  added in the compute dtype and rounded once to the model dtype, for an
  ``out_features`` tile of ``BLOCK_N`` columns per program, looping over the
  rank ``BLOCK_R`` at a time.

Like the attention kernels, this module is a kernel module: Triton decides
when it is first imported whether the kernels compile for the GPU or run in
the interpreter (``TRITON_INTERPRET=1``), so import it only once that is
settled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from engine_pod.lora.adapter import lora_compute_dtype

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SLOT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class LoraBlockSizes:
    """Tile sizes of the two kernels (powers of two, at least 16: ``tl.dot``
    on the GPU wants every side of its operands to be 16 or more).

    ``block_t`` tokens per program, ``block_k`` input features per shrink
    step, ``block_n`` output features per expand program, ``block_r`` ranks
    per shrink program and per expand step. The defaults keep every operand
    tile at most 64 x 64, well inside registers and shared memory; a rank up
    to 64 is then a single tile."""

    block_t: int = 16
    block_k: int = 64
    block_n: int = 64
    block_r: int = 64

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two of at least 16, got {value}")


DEFAULT_BLOCKS = LoraBlockSizes()


@dataclass(frozen=True)
class SlotGroups:
    """The batch's tokens grouped by adapter slot: slot ``s`` owns the tokens
    ``order[bounds[s]:bounds[s + 1]]``. It depends only on the slot indices,
    so a step can build it once and pass it to every projection's call."""

    order: torch.Tensor  # [T] int64, token indices sorted by slot (stable)
    bounds: torch.Tensor  # [num_slots + 1] int64, offsets into order


def group_tokens_by_slot(token_slots: torch.Tensor, num_slots: int) -> SlotGroups:
    """Group tokens by slot with device-side ops only (sort, searchsorted):
    no count is read back to the host, so nothing waits for the GPU and the
    step stays capturable in a CUDA graph. Slots outside [0, num_slots)
    (-1, "no adapter") fall outside every group."""
    sorted_slots, order = torch.sort(token_slots, stable=True)
    starts = torch.arange(num_slots + 1, device=token_slots.device, dtype=sorted_slots.dtype)
    return SlotGroups(order=order, bounds=torch.searchsorted(sorted_slots, starts))


@triton.jit
def _lora_shrink_kernel(
    buf_ptr, x_ptr, a_ptr, order_ptr, bounds_ptr,
    in_features, max_rank,
    stride_buf, stride_x, stride_a_slot, stride_a_rank,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.program_id(1)
    rank_tile = tl.program_id(2)
    begin = tl.load(bounds_ptr + slot)
    end = tl.load(bounds_ptr + slot + 1)
    first = begin + tile * BLOCK_T
    # Most programs of the grid find no token of their slot: the grid is
    # sized for the case where every token uses the same adapter.
    if first >= end:
        return
    pos = first + tl.arange(0, BLOCK_T)
    tok_valid = pos < end
    token = tl.load(order_ptr + pos, mask=tok_valid, other=0).to(tl.int64)
    ranks = rank_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_valid = ranks < max_rank
    compute_ty = a_ptr.dtype.element_ty
    a_slot = a_ptr + slot.to(tl.int64) * stride_a_slot

    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=compute_ty)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_valid = ks < in_features
        x_mask = tok_valid[:, None] & k_valid[None, :]
        x = tl.load(x_ptr + token[:, None] * stride_x + ks[None, :], mask=x_mask, other=0.0)
        # A[s] is [rank, in]; the tile is read transposed, [BLOCK_K, BLOCK_R].
        a_mask = k_valid[:, None] & rank_valid[None, :]
        a_t = tl.load(a_slot + ranks[None, :] * stride_a_rank + ks[:, None], mask=a_mask, other=0.0)
        # x is up-cast to the factors' dtype: the product is the compute
        # dtype's (PEFT up-casts the same way), and "ieee" keeps float32 off
        # the GPU's TF32 tensor-core path, whose 10-bit mantissas would cost
        # ~1e-3 relative error.
        acc += tl.dot(x.to(compute_ty), a_t, input_precision="ieee")
    out_mask = tok_valid[:, None] & rank_valid[None, :]
    tl.store(buf_ptr + pos[:, None] * stride_buf + ranks[None, :], acc, mask=out_mask)


@triton.jit
def _lora_expand_kernel(
    out_ptr, buf_ptr, b_ptr, scalings_ptr, order_ptr, bounds_ptr,
    out_features, max_rank,
    stride_out, stride_buf, stride_b_slot, stride_b_out,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.program_id(1)
    n_tile = tl.program_id(2)
    begin = tl.load(bounds_ptr + slot)
    end = tl.load(bounds_ptr + slot + 1)
    first = begin + tile * BLOCK_T
    if first >= end:
        return
    pos = first + tl.arange(0, BLOCK_T)
    tok_valid = pos < end
    token = tl.load(order_ptr + pos, mask=tok_valid, other=0).to(tl.int64)
    ns = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = ns < out_features
    compute_ty = b_ptr.dtype.element_ty
    b_slot = b_ptr + slot.to(tl.int64) * stride_b_slot
    buf_rows = buf_ptr + pos[:, None] * stride_buf

    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=compute_ty)
    for r_start in range(0, max_rank, BLOCK_R):
        ranks = r_start + tl.arange(0, BLOCK_R)
        rank_valid = ranks < max_rank
        h = tl.load(buf_rows + ranks[None, :], mask=tok_valid[:, None] & rank_valid[None, :], other=0.0)
        # B[s] is [out, rank]; the tile is read transposed, [BLOCK_R, BLOCK_N].
        b_mask = rank_valid[:, None] & n_valid[None, :]
        b_t = tl.load(b_slot + ns[None, :] * stride_b_out + ranks[:, None], mask=b_mask, other=0.0)
        acc += tl.dot(h, b_t, input_precision="ieee")
    # The scaling multiplies the expanded product, as PEFT does
    # (lora_B(lora_A(x)) * scaling): scaling the rank-sized intermediate
    # instead would be cheaper but rounds differently.
    scaling = tl.load(scalings_ptr + slot).to(compute_ty)
    out_mask = tok_valid[:, None] & n_valid[None, :]
    out = out_ptr + token[:, None] * stride_out + ns[None, :]
    base = tl.load(out, mask=out_mask, other=0.0).to(compute_ty)
    result = base + acc * scaling
    if ROUND_BF16_BY_HAND:
        result = _round_to_bfloat16_values(result)
    # One rounding to the model dtype, after the add.
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _round_to_bfloat16_values(v):
    """float32 ``v`` rounded to the nearest bfloat16 value, ties to even,
    still as float32 (its low 16 bits zero). The interpreter converts
    float32 to bfloat16 by dropping the low bits (rounding toward zero)
    where the GPU rounds to nearest even; after this, its truncation is
    exact and both give the GPU's (and torch's) bfloat16."""
    bits = v.to(tl.uint32, bitcast=True)
    # Adding 0x7FFF, plus 1 when the kept part is odd, carries into the kept
    # bits exactly when the dropped half is above (or at a tie, to even)
    # the midpoint; a carry out of the mantissa correctly bumps the exponent,
    # up to infinity.
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    # A NaN's payload could carry into the sign and wrap around: keep it.
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


# Whether Triton made these kernels interpreted ones (TRITON_INTERPRET=1 at
# this module's import), which changes how float32 becomes bfloat16.
_INTERPRETED = isinstance(_lora_expand_kernel, InterpretedFunction)


def add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    *,
    groups: SlotGroups | None = None,
    blocks: LoraBlockSizes = DEFAULT_BLOCKS,
) -> None:
    """Add each token's adapter product into ``out`` [T, out_features] in
    place (it may be a column slice of a wider output, e.g. a fused QKV):
    ``out[t] = (out[t] + (x[t] @ A[s]^T) @ B[s]^T * scalings[s])`` in the
    compute dtype, rounded once, for ``s = token_slots[t] >= 0``. Rows of
    tokens with slot -1 are left untouched.

    ``x`` [T, in_features] is in the model dtype; ``lora_a`` [slots, rank,
    in_features] and ``lora_b`` [slots, out_features, rank] in the compute
    dtype (float64 for a float64 model, float32 otherwise), zero-padded to a
    common rank; ``scalings`` [slots] float32. ``groups`` (from
    ``group_tokens_by_slot``) may be shared by every call of one step.

    Slot values are not range-checked (that would read them back to the
    host): a slot outside [-1, slots) is treated like -1."""
    _check_arguments(out, x, lora_a, lora_b, token_slots, scalings)
    num_tokens, in_features = x.shape
    num_slots, max_rank, _ = lora_a.shape
    out_features = lora_b.shape[1]
    if num_tokens == 0 or num_slots == 0 or max_rank == 0 or out_features == 0:
        return  # nothing to add (and an empty grid axis is not a launch)
    if groups is None:
        groups = group_tokens_by_slot(token_slots, num_slots)
    _check_groups(groups, num_tokens, num_slots)

    # Rows of tokens without an adapter are never written nor read.
    buf = torch.empty((num_tokens, max_rank), dtype=lora_a.dtype, device=x.device)
    token_tiles = triton.cdiv(num_tokens, blocks.block_t)
    # Small ranks (8, 16) are common: a rank tile no wider than the padded
    # rank saves multiplying columns of zeros.
    block_r = min(blocks.block_r, max(16, triton.next_power_of_2(max_rank)))
    _lora_shrink_kernel[(token_tiles, num_slots, triton.cdiv(max_rank, block_r))](
        buf, x, lora_a, groups.order, groups.bounds,
        in_features, max_rank,
        buf.stride(0), x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_T=blocks.block_t, BLOCK_K=blocks.block_k, BLOCK_R=block_r,
    )
    _lora_expand_kernel[(token_tiles, num_slots, triton.cdiv(out_features, blocks.block_n))](
        out, buf, lora_b, scalings, groups.order, groups.bounds,
        out_features, max_rank,
        out.stride(0), buf.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_T=blocks.block_t, BLOCK_N=blocks.block_n, BLOCK_R=block_r,
        ROUND_BF16_BY_HAND=_INTERPRETED and x.dtype == torch.bfloat16,
    )


def _check_arguments(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
) -> None:
    """Refuse what the kernels would misread: they trust shapes, dtypes and
    unit column strides, and a mistake there reads the wrong memory rather
    than failing."""
    _check_ranks(out, x, lora_a, lora_b, token_slots, scalings)
    _check_dtypes(out, x, lora_a, lora_b, token_slots, scalings)
    _check_shapes(out, x, lora_a, lora_b, token_slots, scalings)
    _check_layout(out, x, lora_a, lora_b, token_slots, scalings)


def _check_ranks(*tensors: torch.Tensor) -> None:
    names = ("out", "x", "lora_a", "lora_b", "token_slots", "scalings")
    for name, tensor, ndim in zip(names, tensors, (2, 2, 3, 3, 1, 1), strict=True):
        if tensor.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")


def _check_dtypes(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
) -> None:
    if x.dtype not in MODEL_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported: {', '.join(map(str, MODEL_DTYPES))}")
    if out.dtype != x.dtype:
        raise ValueError(f"out has dtype {out.dtype}, x has {x.dtype}: they must match")
    expected = lora_compute_dtype(x.dtype)
    if lora_a.dtype != expected or lora_b.dtype != expected:
        raise ValueError(
            f"lora_a and lora_b must be {expected} for a {x.dtype} model, got {lora_a.dtype} and {lora_b.dtype}"
        )
    if token_slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    if scalings.dtype != torch.float32:
        raise ValueError(f"scalings must be float32, got {scalings.dtype}")


def _check_shapes(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
) -> None:
    num_tokens, in_features = x.shape
    num_slots, max_rank, a_in = lora_a.shape
    b_slots, out_features, b_rank = lora_b.shape
    if out.shape[0] != num_tokens or token_slots.shape[0] != num_tokens:
        raise ValueError(
            f"x has {num_tokens} tokens but out has {out.shape[0]} rows and token_slots {token_slots.shape[0]}"
        )
    if a_in != in_features:
        raise ValueError(f"lora_a takes {a_in} input features but x has {in_features}")
    if out.shape[1] != out_features:
        raise ValueError(f"lora_b produces {out_features} output features but out has {out.shape[1]}")
    if (b_slots, b_rank) != (num_slots, max_rank):
        raise ValueError(
            f"lora_a has {num_slots} slots of rank {max_rank} but lora_b has {b_slots} slots of rank {b_rank}"
        )
    if scalings.shape[0] != num_slots:
        raise ValueError(f"scalings has {scalings.shape[0]} entries for {num_slots} slots")


def _check_layout(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
) -> None:
    # Rows may be strided (a column slice of a fused output), columns not:
    # the kernels address a row's elements as base + column.
    for name, tensor in (("out", out), ("x", x)):
        if tensor.shape[1] > 1 and tensor.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}")
    for name, tensor in (("lora_a", lora_a), ("lora_b", lora_b), ("token_slots", token_slots),
                         ("scalings", scalings)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    devices = {t.device for t in (out, x, lora_a, lora_b, token_slots, scalings)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_groups(groups: SlotGroups, num_tokens: int, num_slots: int) -> None:
    if groups.order.shape != (num_tokens,) or groups.bounds.shape != (num_slots + 1,):
        raise ValueError(
            f"groups were built for {groups.order.shape[0]} tokens and {groups.bounds.shape[0] - 1} slots, "
            f"not {num_tokens} tokens and {num_slots} slots"
        )
