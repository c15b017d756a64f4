"""The batched multi-LoRA kernels (engine_pod/lora/triton_ops.py) against a
row-by-row torch reference of the same semantics, under TRITON_INTERPRET=1
on CPU (see tests/conftest.py) or natively on CUDA.

Shapes are small on purpose: the interpreter runs every program in numpy.
Small tiles (``SMALL_BLOCKS``) stand in for large shapes: with 16-wide tiles
a 40-token batch spans three token tiles, 72 input features five K steps
with a ragged tail, and a rank of 40 three rank tiles, the last ragged.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from engine_pod.attention.triton_ops.support import interpreter_enabled  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Triton fixed at the kernel module's first import whether it runs on the GPU
# or in the interpreter: import it only where one of the two will work.
if DEVICE.type == "cpu" and not interpreter_enabled():
    pytest.skip("without CUDA the triton kernels run only under TRITON_INTERPRET=1", allow_module_level=True)

from engine_pod.lora.adapter import lora_compute_dtype  # noqa: E402
from engine_pod.lora.triton_ops import (  # noqa: E402
    LoraBlockSizes,
    add_lora_triton,
    group_tokens_by_slot,
)

SMALL_BLOCKS = LoraBlockSizes(block_t=16, block_k=16, block_n=16, block_r=16)


def add_lora_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
) -> None:
    """The operation's definition, one token at a time: shrink, expand,
    scale, add in the factors' (compute) dtype, round once to out's dtype;
    tokens of slot -1 are skipped."""
    cd = lora_a.dtype
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        delta = ((x[t].to(cd) @ lora_a[s].T) @ lora_b[s].T) * scalings[s]
        out[t] = (out[t].to(cd) + delta).to(out.dtype)


@dataclass
class Batch:
    out: torch.Tensor
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    token_slots: torch.Tensor
    scalings: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.out, self.x, self.lora_a, self.lora_b, self.token_slots, self.scalings


def make_adapters(
    ranks: list[int], max_rank: int, in_features: int, out_features: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One adapter per slot, of its own rank, zero-padded to max_rank (rows
    of A, columns of B), with PEFT's scaling alpha / r for alpha = 2 r or so,
    distinct per slot so that a kernel mixing up slots or scalings shows."""
    cd = lora_compute_dtype(dtype)
    lora_a = torch.zeros(len(ranks), max_rank, in_features, dtype=cd)
    lora_b = torch.zeros(len(ranks), out_features, max_rank, dtype=cd)
    for slot, r in enumerate(ranks):
        lora_a[slot, :r] = torch.randn(r, in_features, generator=gen, dtype=cd) / in_features**0.5
        lora_b[slot, :, :r] = torch.randn(out_features, r, generator=gen, dtype=cd) / r**0.5
    alphas = torch.tensor([2.0 * r + 3.0 * slot for slot, r in enumerate(ranks)])
    scalings = (alphas / torch.tensor(ranks, dtype=torch.float32)).to(torch.float32)
    return lora_a, lora_b, scalings


def make_batch(
    slots: list[int],
    ranks: list[int],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    max_rank: int | None = None,
    seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    lora_a, lora_b, scalings = make_adapters(ranks, max_rank or max(ranks), in_features, out_features, dtype, gen)
    x = torch.randn(len(slots), in_features, generator=gen).to(dtype)
    out = torch.randn(len(slots), out_features, generator=gen).to(dtype)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    return Batch(*(t.to(DEVICE) for t in (out, x, lora_a, lora_b, token_slots, scalings)))


def interleaved_slots(num_tokens: int, num_slots: int) -> list[int]:
    """Slots in an order no tile boundary lines up with: runs, alternation,
    and tokens without an adapter (-1) mixed in."""
    pattern = [0, 0, -1, 1, 2, 1, 0, -1, 2, 2, 2, 1]
    return [s if s < num_slots else s % num_slots for s in (pattern * num_tokens)[:num_tokens]]


def run_both(batch: Batch, blocks: LoraBlockSizes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel result, reference result), each from its own copy of out."""
    expected = batch.out.clone()
    add_lora_reference(expected, *batch.args()[1:])
    got = batch.out.clone()
    add_lora_triton(got, *batch.args()[1:], blocks=blocks or LoraBlockSizes())
    return got, expected


def ulp(values: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each value, in its own dtype."""
    info = torch.finfo(values.dtype)
    mag = values.float().abs().clamp_min(info.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def assert_matches_reference(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.float64:
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    elif got.dtype == torch.float32:
        # The same float32 sums in another order (tl.dot's tiles vs torch's
        # matmul): a few float32 ulps of the summands' size.
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        # Both sides compute in float32 and round once to 16 bits; their
        # float32 values differ by a few float32 ulps (summation order), so
        # the rounded results are equal except where a value lies within
        # that distance of a rounding boundary, and there they differ by
        # exactly one 16-bit ulp. Such elements are rare.
        diff = (got.float() - expected.float()).abs()
        assert (diff <= ulp(torch.maximum(got.abs(), expected.abs()))).all(), diff.max()
        assert (diff > 0).float().mean() <= 0.01, (diff > 0).float().mean()


def assert_rows_untouched(got: torch.Tensor, before: torch.Tensor, rows: torch.Tensor) -> None:
    """Bit for bit: compared as raw bytes, so NaN and -0.0 count too."""
    assert torch.equal(got[rows].view(torch.uint8), before[rows].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_mixed_slots_match_reference(dtype):
    # Odd feature sizes (72 in, 40 out), ranks 1, 7 and 16 padded to 16.
    batch = make_batch(interleaved_slots(40, 3), [1, 7, 16], 72, 40, dtype)
    got, expected = run_both(batch, SMALL_BLOCKS)
    assert_matches_reference(got, expected)
    assert_rows_untouched(got, batch.out, batch.token_slots < 0)


def test_default_blocks_match_reference():
    # One tile for everything: the ragged masks of a single 64-wide tile.
    batch = make_batch(interleaved_slots(24, 2), [3, 5], 40, 72, torch.float32)
    got, expected = run_both(batch)
    assert_matches_reference(got, expected)


def test_rows_without_adapter_are_not_touched_even_if_nan():
    batch = make_batch([-1, 0, -1, 1, -1], [4, 2], 24, 20, torch.bfloat16)
    no_adapter = batch.token_slots < 0
    batch.out[no_adapter] = torch.tensor(float("nan"), dtype=batch.out.dtype)
    batch.out[0, :4] = -0.0
    got, expected = run_both(batch, SMALL_BLOCKS)
    assert_rows_untouched(got, batch.out, no_adapter)
    assert_matches_reference(got[~no_adapter], expected[~no_adapter])


def test_all_tokens_without_adapter_change_nothing():
    batch = make_batch([-1] * 5, [4], 24, 20, torch.float32)
    got, _ = run_both(batch, SMALL_BLOCKS)
    assert_rows_untouched(got, batch.out, batch.token_slots < 0)


def test_zero_padded_rank_gives_the_unpadded_result():
    # Slot 0 of rank 5, stored at max_rank 5 and zero-padded to 16: the
    # padded terms are exact zeros, and both fit one rank tile padded to
    # the same width, so the results are equal bit for bit.
    tight = make_batch([0, 0, 0, 0, 0, 0], [5], 40, 24, torch.float32)
    padded = make_batch([0, 0, 0, 0, 0, 0], [5], 40, 24, torch.float32, max_rank=16)
    assert torch.equal(padded.lora_a[:, :5], tight.lora_a) and torch.equal(padded.x, tight.x)
    got_tight, expected = run_both(tight, SMALL_BLOCKS)
    got_padded, _ = run_both(padded, SMALL_BLOCKS)
    assert torch.equal(got_tight, got_padded)
    assert_matches_reference(got_padded, expected)


@pytest.mark.parametrize(
    "max_rank, blocks",
    [
        (64, SMALL_BLOCKS),  # four 16-wide rank tiles
        (40, SMALL_BLOCKS),  # three, the last one ragged (8 of 16)
        (64, LoraBlockSizes()),  # the default: one 64-wide tile
    ],
    ids=["64-tiled", "40-ragged", "64-default"],
)
def test_large_ranks(max_rank, blocks):
    # Slot 1 has rank 24, zero-padded to max_rank: whole tiles of zeros.
    batch = make_batch([1, 0, 1, -1, 0, 0, 1], [max_rank, 24], 40, 24, torch.float32)
    got, expected = run_both(batch, blocks)
    assert_matches_reference(got, expected)


def test_out_may_be_a_column_slice_of_a_wider_output():
    batch = make_batch(interleaved_slots(12, 3), [2, 8, 4], 40, 24, torch.bfloat16)
    # A fused QKV projection's output [T, 96]; the adapter writes columns 64:88.
    fused = torch.randn(12, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    fused[:, 64:88] = batch.out
    before = fused.clone()
    add_lora_triton(fused[:, 64:88], *batch.args()[1:], blocks=SMALL_BLOCKS)
    _, expected = run_both(batch, SMALL_BLOCKS)
    assert_matches_reference(fused[:, 64:88], expected)
    outside = torch.ones(96, dtype=torch.bool)
    outside[64:88] = False
    assert torch.equal(fused[:, outside].view(torch.uint8), before[:, outside].view(torch.uint8))


def test_single_token():
    batch = make_batch([1], [3, 6], 40, 24, torch.float32)
    got, expected = run_both(batch)
    assert_matches_reference(got, expected)


def test_int64_slots_and_shared_groups():
    batch = make_batch(interleaved_slots(20, 3), [2, 3, 4], 24, 20, torch.float32)
    batch.token_slots = batch.token_slots.long()
    got, expected = run_both(batch)
    assert_matches_reference(got, expected)
    # The grouping depends only on the slots: one step builds it once.
    groups = group_tokens_by_slot(batch.token_slots, num_slots=3)
    shared = batch.out.clone()
    add_lora_triton(shared, *batch.args()[1:], groups=groups)
    assert torch.equal(shared, got)


def test_empty_batch_is_a_no_op():
    batch = make_batch([], [4], 24, 20, torch.float32)
    add_lora_triton(*batch.args())
    assert batch.out.shape == (0, 20)


def test_cases_tell_slots_and_scalings_apart():
    """The comparisons above would catch a kernel that ignored the scaling
    or used one slot's factors for every token: on these inputs both
    mistakes move the result far outside the tolerances."""
    batch = make_batch(interleaved_slots(40, 3), [1, 7, 16], 72, 40, torch.float32)
    _, expected = run_both(batch)
    unscaled = batch.out.clone()
    x, lora_a, lora_b, token_slots, scalings = batch.args()[1:]
    add_lora_reference(unscaled, x, lora_a, lora_b, token_slots, torch.ones_like(scalings))
    one_slot = batch.out.clone()
    add_lora_reference(one_slot, x, lora_a, lora_b, token_slots.clamp_max(0), scalings)
    for wrong in (unscaled, one_slot):
        assert (wrong - expected).abs().max() > 0.1


@pytest.mark.parametrize(
    "field, replace, match",
    [
        ("x", lambda b: b.x[:, :-1], "lora_a takes 24 input features but x has 23"),
        ("out", lambda b: b.out[:, :-1], "lora_b produces 20 output features but out has 19"),
        ("out", lambda b: b.out[:-1], "x has 6 tokens but out has 5 rows"),
        ("token_slots", lambda b: b.token_slots[:-1], "token_slots 5"),
        ("token_slots", lambda b: b.token_slots.float(), "token_slots must be int32 or int64"),
        ("scalings", lambda b: b.scalings[:-1], "scalings has 1 entries for 2 slots"),
        ("scalings", lambda b: b.scalings.double(), "scalings must be float32"),
        ("lora_b", lambda b: b.lora_b[:, :, :-1], "lora_b has 2 slots of rank 3"),
        ("lora_b", lambda b: b.lora_b[:1], "lora_b has 1 slots"),
        ("lora_a", lambda b: b.lora_a.to(torch.bfloat16), "lora_a and lora_b must be torch.float32"),
        ("lora_a", lambda b: b.lora_a[0], "lora_a must have 3 dimensions"),
        ("lora_a", lambda b: b.lora_a.transpose(1, 2).contiguous().transpose(1, 2), "lora_a must be contiguous"),
        ("out", lambda b: b.out.to(torch.float16), "out has dtype torch.float16"),
        ("out", lambda b: b.out.t().contiguous().t(), "out must be contiguous in its last dimension"),
        ("x", lambda b: b.x.t().contiguous().t(), "x must be contiguous in its last dimension"),
        ("x", lambda b: b.x.to(torch.int32), "x has dtype torch.int32"),
    ],
    ids=lambda v: "" if callable(v) else str(v),
)
def test_invalid_arguments_are_refused(field, replace, match):
    batch = make_batch([0, 1, -1, 0, 1, 1], [4, 3], 24, 20, torch.bfloat16)
    setattr(batch, field, replace(batch))
    before = batch.out.clone()
    with pytest.raises(ValueError, match=match):
        add_lora_triton(*batch.args())
    if batch.out.shape == before.shape:
        assert torch.equal(batch.out, before)


def test_block_sizes_must_suit_tl_dot():
    with pytest.raises(ValueError, match="block_r must be a power of two of at least 16"):
        LoraBlockSizes(block_r=8)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        LoraBlockSizes(block_k=48)
