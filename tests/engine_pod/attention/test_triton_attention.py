"""The triton attention backend's kernels against the torch backend and the
float64 reference, on the shared randomized cases (under TRITON_INTERPRET=1
on CPU, see tests/conftest.py; natively on CUDA), and its launch planning."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine_pod.attention.triton_ops.plan import KernelShape, SplitRule, plan_step, query_tiles
from tessera_tools.fixtures.attention_cases import CORRECTNESS_CASES, TEST_SPLIT_RULE, TOLERANCES, build_case, run_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("case", CORRECTNESS_CASES, ids=lambda c: c.id)
def test_kernels_match_torch_backend(case):
    result = run_case(case, DEVICE)
    # The cache write is a copy: bit for bit the torch backend's.
    assert result.cache_equal
    assert (result.num_splits > 1) == case.split, result.num_splits
    tol = TOLERANCES[case.dtype]
    assert result.err_vs_torch <= tol, result
    assert result.err_vs_reference <= tol, result
    assert result.passed


def test_cases_cover_every_pair_of_axes():
    axes = {
        "block size": lambda c: c.block_size, "GQA ratio": lambda c: c.num_heads // c.num_kv_heads,
        "head size": lambda c: c.head_dim, "dtype": lambda c: c.dtype, "split": lambda c: c.split,
    }
    assert {axes["block size"](c) for c in CORRECTNESS_CASES} == {8, 16, 32}
    assert {axes["GQA ratio"](c) for c in CORRECTNESS_CASES} == {1, 4, 8}
    assert {axes["head size"](c) for c in CORRECTNESS_CASES} == {64, 128}
    for (a, fa), (b, fb) in itertools.combinations(axes.items(), 2):
        seen = {(fa(c), fb(c)) for c in CORRECTNESS_CASES}
        values_a, values_b = {fa(c) for c in CORRECTNESS_CASES}, {fb(c) for c in CORRECTNESS_CASES}
        assert len(seen) == len(values_a) * len(values_b), (a, b)


def test_layers_reuse_the_step_plan():
    from engine_pod.attention.triton_backend import TritonAttentionBackend

    case = next(c for c in CORRECTNESS_CASES if c.split and c.num_heads // c.num_kv_heads == 8)
    step = build_case(case, DEVICE)
    backend = TritonAttentionBackend(TEST_SPLIT_RULE)
    first = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, step.scale)
    launches = step.metadata.backend_cache["triton_launches"]
    # A second layer of the same step: same plan objects, same result.
    second = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, step.scale)
    assert step.metadata.backend_cache["triton_launches"] is launches
    assert torch.equal(first, second)


def test_strided_rows_are_read_through_strides_but_a_strided_head_dim_is_refused():
    from engine_pod.attention.triton_backend import TritonAttentionBackend

    case = next(c for c in CORRECTNESS_CASES if not c.split and c.dtype == torch.float32)
    step = build_case(case, DEVICE)
    backend = TritonAttentionBackend(TEST_SPLIT_RULE)
    # Rows of a fused QKV projection: every token's query is a strided view.
    fused = torch.cat([step.query, step.query], dim=1)
    out = backend.forward(fused[:, : case.num_heads], step.key, step.value, step.kv_cache, step.metadata, step.scale)
    assert torch.equal(out, backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, step.scale))
    wide = torch.stack([step.key, step.key], dim=-1)  # [T, Hkv, D, 2]
    with pytest.raises(ValueError, match="key must be contiguous in its last"):
        backend.forward(step.query, wide[..., 0], step.value, step.kv_cache, step.metadata, step.scale)


def test_query_tiles_cover_every_token_once():
    q_lens = np.array([5, 1, 8, 9])
    seqs, starts = query_tiles(q_lens, first_seq=3, block_q=4)
    assert seqs.tolist() == [3, 3, 4, 5, 5, 6, 6, 6]
    assert starts.tolist() == [0, 4, 0, 0, 4, 0, 4, 8]


@pytest.mark.parametrize(
    "num_decodes, max_context, expected",
    [
        (1, 32768, 64),  # one long sequence: as many splits as allowed
        (4, 32768, 17),  # ceil(2 waves x 132 SMs / 16 programs)
        (64, 4096, 1),  # 512 programs already fill 132 SMs
        (1, 511, 1),  # under two splits' worth of keys
        (1, 1024, 4),  # bounded by min_keys_per_split
    ],
)
def test_split_rule(num_decodes, max_context, expected):
    rule = SplitRule(num_sms=132, min_keys_per_split=256)
    assert rule.num_splits(num_decodes, num_kv_heads=4, max_context=max_context) == expected


def test_plan_splits_decodes_only_and_covers_the_longest_context():
    shape = KernelShape(num_heads=32, num_kv_heads=8, head_dim=128)
    q_lens = np.array([1, 1, 300])
    seq_lens = np.array([4000, 17, 300])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    decode, prefill = plan_step(qsl, seq_lens, 2, shape, SplitRule(num_sms=132))
    assert decode.num_splits > 1 and decode.split_len % 16 == 0
    assert (decode.num_splits - 1) * decode.split_len < 4000 <= decode.num_splits * decode.split_len
    assert decode.tile_seq.tolist() == [0, 1]
    assert prefill.num_splits == 1 and set(prefill.tile_seq.tolist()) == {2}
    assert len(prefill.tile_seq) * prefill.block_q >= 300
