"""The cpu backend's LoRA row kernel (attention/cpu_ops/lora_rows.cpp), which CPU steps of few
rows run instead of two GEMMs per projection: against a float64 reference, and in the engine
against the GEMM path."""

from __future__ import annotations

import random

import pytest
import torch

from engine_pod import LLM, LoRARequest, SamplingParams
from engine_pod.attention.cpu_ops.build import load_cpu_ops
from engine_pod.lora import layers

pytestmark = pytest.mark.skipif(load_cpu_ops() is not None, reason="the cpu backend's kernels did not build here")


def reference(out, x, a, bt, slots, ranks):
    """out[t] + (x[t] . A[s, :r]^T) . Bt[s, :r] in float64, for rows of slot s >= 0."""
    want = out.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            r = ranks[s]
            want[t] += (x[t].double() @ a[s, :r].double().T) @ bt[s, :r].double()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_a_float64_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    rows, in_features, cols, num_slots, max_rank = 37, 72, 40, 3, 16
    ranks = [16, 5, 0]
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    a = (torch.randn(num_slots, max_rank, in_features, generator=gen) * 0.2).to(dtype)
    bt = (torch.randn(num_slots, max_rank, cols, generator=gen) * 0.2).to(dtype)
    slots = torch.tensor([random.Random(1).choice([-1, 0, 1, 2]) for _ in range(rows)], dtype=torch.int32)
    wide = torch.randn(rows, cols + 24, generator=gen).to(dtype)
    before = wide.clone()
    out = wide[:, 8 : 8 + cols]  # a column slice, as q inside a merged q/k/v
    want = reference(out, x, a, bt, slots, ranks)
    torch.ops.tessera_cpu.lora_rows(x, a, bt, slots, ranks, out)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=tolerance, atol=tolerance)
    # Outside the slice, rows of the base model and the rank-0 slot: untouched, bit for bit.
    untouched = (slots < 0) | (slots == 2)
    assert torch.equal(wide[untouched], before[untouched])
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 8 + cols :], before[:, 8 + cols :])


def test_values_past_a_slots_rank_are_never_read():
    x, a, bt = torch.randn(4, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 6)
    a[0, 2:], bt[0, 2:] = float("nan"), float("nan")
    out = torch.zeros(4, 6)
    torch.ops.tessera_cpu.lora_rows(x, a, bt, torch.zeros(4, dtype=torch.int32), [2], out)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("change", "match"), [
    (dict(slots=torch.zeros(4, dtype=torch.int64)), "int32"),
    (dict(ranks=[5]), "outside"),
    (dict(out=torch.zeros(4, 7)), "out must be"),
    (dict(x=torch.zeros(4, 8, dtype=torch.float64)), "share a dtype"),
])
def test_bad_arguments_are_refused(change, match):
    args = dict(x=torch.randn(4, 8), a=torch.randn(1, 4, 8), bt=torch.randn(1, 4, 6),
                slots=torch.zeros(4, dtype=torch.int32), ranks=[4], out=torch.zeros(4, 6))
    args.update(change)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.tessera_cpu.lora_rows(*args.values())


def test_the_engine_gives_the_gemm_paths_tokens(tiny_llama, tiny_llama_loras, monkeypatch):
    """float32, all steps at most 64 rows (a 16-token budget): the row kernel, then the two-GEMM
    path for the same steps; three adapters and the base model mixed."""
    prompts = [{"prompt_token_ids": [5 + i, 17, 300 + 7 * i, 42] * 3} for i in range(6)]
    loras = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(tiny_llama_loras)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for rows_limit in (layers.ROWS_KERNEL_MAX_ROWS, 0):
        monkeypatch.setattr(layers, "ROWS_KERNEL_MAX_ROWS", rows_limit)
        llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20,
                  enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=16,
                  attention_backend="cpu")
        assert llm.engine_core.executor.runner.lora.ctx.use_rows_kernel
        outs = llm.generate(prompts, params, lora_request=[loras[i % 4] for i in range(len(prompts))])
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]
