"""The cpu backend's C++ attention kernels (engine_pod/attention/cpu_ops:
decodes from the paged cache, prefill chunks as GEMMs) against the torch
backend and the float64 reference, on the randomized cases the triton
kernels are tested with, plus the dtypes and head sizes only a CPU engine
runs (float64, head sizes other than 64 and 128)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_pod.attention.cpu_backend import CpuAttentionBackend
from engine_pod.attention.cpu_ops.build import extension_name, load_cpu_ops
from engine_pod.attention.torch_backend import TorchAttentionBackend
from tessera_tools.fixtures.attention_cases import CORRECTNESS_CASES, build_case, reference_attention

CPU = torch.device("cpu")
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}

# The shared cases, and the generic (not unrolled) head-size path in every dtype.
CASES = CORRECTNESS_CASES + [
    dataclasses.replace(CORRECTNESS_CASES[i], head_dim=dim, dtype=dtype, seed=100 + i)
    for i, (dim, dtype) in enumerate(
        [(64, torch.float64), (32, torch.float32), (80, torch.float64), (96, torch.bfloat16), (16, torch.float16)]
    )
]


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert load_cpu_ops() is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernels_match_torch_backend_and_reference(case):
    step = build_case(case, CPU)
    torch_cache = step.kv_cache.clone()
    out = CpuAttentionBackend().forward(step.query, step.key, step.value, step.kv_cache, step.metadata, step.scale)
    step.metadata.backend_cache.clear()
    expected = TorchAttentionBackend().forward(step.query, step.key, step.value, torch_cache, step.metadata, step.scale)
    ref = reference_attention(step.query, step.kv_cache, step.metadata, step.tables, step.scale)
    assert torch.equal(step.kv_cache, torch_cache)  # the same cache write
    tol = TOLERANCES[case.dtype]
    nd = step.metadata.num_decodes
    assert nd == 4
    # Decodes and prefill chunks (fresh, and after cached context) both run
    # kernels, except float64 prefills (the torch path). The kernels
    # accumulate in float32 (float64 for float64), so in half precision they
    # are closer to the reference than the torch path they are compared
    # with: that comparison allows both sides' rounding.
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), expected.double(), rtol=tol, atol=tol)
    if case.dtype == torch.float64:
        assert torch.equal(out[nd:], expected[nd:])


def test_query_rows_are_read_through_their_strides():
    case = CORRECTNESS_CASES[1]
    step = build_case(case, CPU)
    nd = step.metadata.num_decodes
    # A query that is a view into a wider [T, 2 * Hq, D] tensor, as a q/k/v split leaves it.
    wide = torch.randn(step.query.shape[0], 2 * case.num_heads, case.head_dim).to(case.dtype)
    wide[:, : case.num_heads] = step.query
    strided = wide[:, : case.num_heads]
    assert not strided.is_contiguous()
    out = torch.empty_like(step.query)
    md = step.metadata
    torch.ops.tessera_cpu.paged_decode(strided[:nd], step.kv_cache[0], step.kv_cache[1], md.block_table[:nd],
                                       md.seq_lens[:nd], step.scale, out[:nd])
    ref = reference_attention(step.query, step.kv_cache, md, step.tables, step.scale)
    tol = TOLERANCES[case.dtype]
    torch.testing.assert_close(out[:nd].double(), ref[:nd], rtol=tol, atol=tol)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "block_table": a["block_table"].int()}, "block_table and seq_lens must be int64"),
    (lambda a: {**a, "key_cache": a["key_cache"].double()}, "must share a dtype"),
    (lambda a: {**a, "out": a["out"][:, :1]}, "out must be a contiguous tensor shaped like query"),
    (lambda a: {**a, "query": a["query"][:, :3]}, "not a multiple of KV heads"),
    (lambda a: {**a, "value_cache": a["value_cache"][:-1]}, "key and value caches differ in shape"),
    (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "one block-table row and one length per query"),
])
def test_bad_arguments_are_refused_with_a_message(change, message):
    case = CORRECTNESS_CASES[2]  # 8 query heads over 2 KV heads
    step = build_case(case, CPU)
    nd = step.metadata.num_decodes
    args = {"query": step.query[:nd], "key_cache": step.kv_cache[0], "value_cache": step.kv_cache[1],
            "block_table": step.metadata.block_table[:nd], "seq_lens": step.metadata.seq_lens[:nd],
            "scale": step.scale, "out": torch.empty_like(step.query[:nd])}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tessera_cpu.paged_decode(**change(args))


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "key": a["key"][:3], "value": a["value"][:3]}, "fewer keys than queries"),
    (lambda a: {**a, "value": a["value"][:, :1]}, "key and value must match"),
    (lambda a: {**a, "query": a["query"][:, :3]}, "multiple of KV heads"),
    (lambda a: {**a, "out": a["out"][:, :1]}, "out must be a contiguous tensor shaped like query"),
    (lambda a: {**a, "key": a["key"].half()}, "must share a dtype"),
    (lambda a: {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in a.items()},
     "float32, bfloat16 or float16 expected"),
])
def test_bad_prefill_arguments_are_refused_with_a_message(change, message):
    args = {"query": torch.randn(5, 8, 64), "key": torch.randn(9, 2, 64), "value": torch.randn(9, 2, 64),
            "scale": 0.125, "out": torch.empty(5, 8, 64)}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tessera_cpu.prefill_attention(**change(args))


def _paged_prefill_args(dtype=torch.float32):
    """A 5-token chunk after 11 cached positions: 16 positions in blocks 3, 0 (block size 8)."""
    cache = torch.randn(2, 4, 8, 2, 64).to(dtype)
    return {"query": torch.randn(5, 8, 64).to(dtype), "key_cache": cache[0], "value_cache": cache[1],
            "block_table_row": torch.tensor([3, 0, 0]), "seq_len": 16, "scale": 0.125,
            "out": torch.empty(5, 8, 64).to(dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_prefill_reads_its_context_through_the_block_table(dtype):
    """prefill_attention_paged (in place, bf16; gathered, float32) equals prefill_attention over the
    context gathered by hand, and reads no block the table does not name."""
    args = _paged_prefill_args(dtype)
    args["key_cache"][1:3] = float("nan")  # blocks outside the table: a read of one would show
    args["value_cache"][1:3] = float("nan")
    torch.ops.tessera_cpu.prefill_attention_paged(**args)
    k = args["key_cache"][[3, 0]].reshape(16, 2, 64)
    v = args["value_cache"][[3, 0]].reshape(16, 2, 64)
    expected = torch.empty_like(args["out"])
    torch.ops.tessera_cpu.prefill_attention(args["query"], k, v, 0.125, expected)
    assert not args["out"].isnan().any()
    assert torch.equal(args["out"], expected)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "block_table_row": torch.tensor([3, 9])}, "block id 9 outside the cache"),
    (lambda a: {**a, "block_table_row": torch.tensor([3, -1])}, "block id -1 outside the cache"),
    (lambda a: {**a, "block_table_row": torch.tensor([3])}, "shorter than seq_len"),
    (lambda a: {**a, "block_table_row": torch.tensor([3, 0], dtype=torch.int32)}, "contiguous int64 vector"),
    (lambda a: {**a, "seq_len": 4}, "seq_len is shorter than the chunk"),
    (lambda a: {**a, "value_cache": a["value_cache"].half()}, "must share a dtype"),
    (lambda a: {**a, "value_cache": a["value_cache"][:3]}, "of one shape expected"),
    (lambda a: {**a, "query": a["query"][:, :3]}, "not a multiple of KV heads"),
    (lambda a: {**a, "out": a["out"][:, :1]}, "out must be a contiguous tensor shaped like query"),
])
def test_bad_paged_prefill_arguments_are_refused_with_a_message(change, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tessera_cpu.prefill_attention_paged(**change(_paged_prefill_args()))


def _shared_prefix_step(dtype=torch.bfloat16, dim=64, block_size=16):
    """Two decodes, then three chunks whose contexts share blocks 0-1 (a cached 32-token prefix)
    and go on in blocks of their own; blocks no table names hold NaN."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, num_blocks = 8, 2, 12
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    cache[:, 10:] = float("nan")
    table = torch.tensor([[5, 0, 0], [6, 0, 0], [0, 1, 2], [0, 1, 3], [0, 1, 4]])
    q_lens, seq_lens = [1, 1, 5, 16, 7], [9, 14, 37, 48, 40]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    query = torch.randn(int(qsl[-1]), heads, dim, generator=gen).to(dtype)
    return query, cache, table, qsl, torch.tensor(seq_lens)


@pytest.mark.parametrize("dim", [64, 128])
def test_a_steps_prefills_in_one_call_equal_them_one_by_one(dim):
    """prefill_attention_batch (each block packed once, shared by the chunks that read it) gives
    every chunk exactly what prefill_attention_paged gives it alone, and leaves decode rows alone."""
    query, cache, table, qsl, seq_lens = _shared_prefix_step(dim=dim)
    if not torch.ops.tessera_cpu.prefill_batch_supported(query, cache[0]):
        pytest.skip("prefill_attention_batch needs AVX-512 BF16")
    out = torch.full_like(query, 7.0)
    torch.ops.tessera_cpu.prefill_attention_batch(query, cache[0], cache[1], table, qsl, seq_lens, 2, 0.125, out)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))
    for i in range(2, 5):
        start, end = int(qsl[i]), int(qsl[i + 1])
        alone = torch.empty_like(query[start:end])
        torch.ops.tessera_cpu.prefill_attention_paged(query[start:end], cache[0], cache[1], table[i],
                                                      int(seq_lens[i]), 0.125, alone)
        assert torch.equal(out[start:end], alone), i
    assert not out.isnan().any()


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "block_table": a["block_table"].clone().index_fill_(1, torch.tensor([2]), 12)},
     "block id 12 outside the cache"),
    (lambda a: {**a, "block_table": a["block_table"][:, :2]}, "block-table row is shorter than its context"),
    (lambda a: {**a, "seq_lens": torch.tensor([9, 14, 3, 48, 40])}, "context is shorter than its chunk"),
    (lambda a: {**a, "first": 6}, "first is outside the sequences"),
    (lambda a: {**a, "query_start_loc": a["query_start_loc"][:-1]}, "one more start than sequences"),
    (lambda a: {**a, "seq_lens": a["seq_lens"].int()}, "must be int64 CPU tensors"),
    (lambda a: {**a, "query": a["query"].float(), "out": a["out"].float()}, "bf16 with head size 64 or 128"),
    (lambda a: {**a, "key_cache": a["key_cache"].float()}, "must share a dtype"),
])
def test_bad_batched_prefill_arguments_are_refused_with_a_message(change, message):
    query, cache, table, qsl, seq_lens = _shared_prefix_step()
    if not torch.ops.tessera_cpu.prefill_batch_supported(query, cache[0]):
        pytest.skip("prefill_attention_batch needs AVX-512 BF16")
    args = {"query": query, "key_cache": cache[0], "value_cache": cache[1], "block_table": table,
            "query_start_loc": qsl, "seq_lens": seq_lens, "first": 2, "scale": 0.125, "out": torch.empty_like(query)}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tessera_cpu.prefill_attention_batch(**change(args))


def test_block_sizes_off_the_tile_take_the_chunk_by_chunk_path():
    query = torch.empty(1, 8, 64, dtype=torch.bfloat16)
    assert not torch.ops.tessera_cpu.prefill_batch_supported(query, torch.empty(4, 8, 2, 64, dtype=torch.bfloat16))
    assert not torch.ops.tessera_cpu.prefill_batch_supported(query.float(), torch.empty(4, 16, 2, 64))


def test_the_build_hashes_the_headers_its_sources_include():
    from engine_pod.attention.cpu_ops import build

    for source in build.SOURCES:
        for line in source.read_text().splitlines():
            if line.startswith('#include "'):
                assert source.with_name(line.split('"')[1]) in build.HEADERS, line


def test_the_build_is_named_after_the_cpu_it_was_compiled_for(monkeypatch):
    from engine_pod.attention.cpu_ops import build

    here = extension_name()
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse2 avx512f")
    # -march=native code must never be loaded on another kind of CPU.
    assert extension_name() != here and extension_name().startswith("tessera_cpu_ops_")


def test_without_a_compiler_the_reason_says_so(monkeypatch, tmp_path):
    from engine_pod.attention.cpu_ops import build

    # No build under this directory, and no compiler to make one.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    reason = build.load_cpu_ops.__wrapped__()
    assert reason == "building the CPU attention kernels failed: no C++ compiler (c++/g++) on PATH"
    assert not any(tmp_path.iterdir())
