"""The layers' C++ kernels on CPU engines (attention/cpu_ops/fused_layers.cpp):
RMSNorm with and without the residual add before it, rotary embedding and
SiLU-times-up, against the torch path of the same modules (Hugging Face's
operator chain), then end to end against Hugging Face.

Every result is the torch path's bit for bit, in float32 as in bf16 and
fp16: the kernels round where HF's operators round and follow torch's order
of summation, its rsqrt and its exp. So the engine's tokens do not move when
the kernels are switched on."""

from __future__ import annotations

import pytest
import torch

from engine_pod import LLM, SamplingParams
from engine_pod.attention.cpu_ops.build import load_cpu_ops
from engine_pod.model.layers import RMSNorm, silu_and_mul
from engine_pod.model.rotary import RotaryEmbedding, compute_inv_freq
from tests.engine_pod.hf_reference import hf_greedy
from tests.engine_pod.prompts import parity_prompts

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The bench model's widths (hidden 768, 12 query and 4 KV heads of 64, intermediate 2304).
# Prompts of 1..200 tokens crossing block boundaries, about half with a shared prefix.
PROMPTS = [p for p in parity_prompts(seed=2) if len(p) <= 200]
TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 37, 768, 12, 4, 64, 2304


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert load_cpu_ops() is None


def _assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(got, expected), f"{(got != expected).sum().item()} of {got.numel()} differ"


def _norms(dtype):
    torch.manual_seed(0)
    torch_norm, kernel_norm = RMSNorm(HIDDEN, 1e-5), RMSNorm(HIDDEN, 1e-5, cpu_kernels=True)
    weight = (1 + 0.2 * torch.randn(HIDDEN)).to(dtype)
    for norm in (torch_norm, kernel_norm):
        norm.weight.data = weight
    return torch_norm, kernel_norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [HIDDEN, 4096, 100], ids=lambda w: f"width{w}")
def test_rms_norm_matches_the_torch_path(dtype, width):
    """Widths that do and do not fill torch's summation levels and vectors."""
    torch.manual_seed(0)
    torch_norm, kernel_norm = RMSNorm(width, 1e-5), RMSNorm(width, 1e-5, cpu_kernels=True)
    kernel_norm.weight.data = torch_norm.weight.data = (1 + 0.2 * torch.randn(width)).to(dtype)
    x = (3 * torch.randn(4 * TOKENS, width)).to(dtype)
    _assert_same(kernel_norm(x), torch_norm(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_and_norm_matches_the_torch_path(dtype):
    torch_norm, kernel_norm = _norms(dtype)
    residual, x = torch.randn(TOKENS, HIDDEN).to(dtype), torch.randn(TOKENS, HIDDEN).to(dtype)
    expected_sum, expected_norm = torch_norm.add_and_norm(residual, x.clone())
    total, normed = kernel_norm.add_and_norm(residual, x)
    assert torch.equal(total, expected_sum)  # one rounded add in every dtype
    _assert_same(normed, expected_norm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_the_torch_path(dtype):
    torch.manual_seed(1)
    # Gates across silu's whole range (exp(-g) overflowing to inf included), and Gaussian ones.
    gates = torch.cat([torch.linspace(-300, 300, TOKENS * INTERMEDIATE).view(TOKENS, -1),
                       4 * torch.randn(TOKENS, INTERMEDIATE)])
    gate_up = torch.cat([gates, torch.randn_like(gates)], dim=1).to(dtype)
    _assert_same(silu_and_mul(gate_up, cpu_kernels=True), silu_and_mul(gate_up, cpu_kernels=False))


def test_silu_matches_the_torch_path_on_every_bfloat16_gate():
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = bits[torch.isfinite(bits.float())].view(1, -1)
    gate_up = torch.cat([gates, torch.ones_like(gates)], dim=1)
    _assert_same(silu_and_mul(gate_up, cpu_kernels=True), silu_and_mul(gate_up, cpu_kernels=False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_the_torch_path_on_qkv_views(dtype):
    inv_freq, scale = compute_inv_freq(HEAD_DIM, 10000.0, None, 2048, 2048)
    torch_rope = RotaryEmbedding(HEAD_DIM, 2048, inv_freq, scale, dtype)
    kernel_rope = RotaryEmbedding(HEAD_DIM, 2048, inv_freq, scale, dtype, cpu_kernels=True)
    # One table for both: the rotation is under test. (Two tables built in one process have
    # been seen to differ, by 1.5e-4 in cos, after the attention tests on an AMX machine.)
    kernel_rope.cos, kernel_rope.sin = torch_rope.cos, torch_rope.sin
    torch.manual_seed(2)
    qkv = torch.randn(TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    positions = torch.randint(0, 2048, (TOKENS,))

    def views(t):
        q, k, _ = t.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        return q.view(TOKENS, HEADS, HEAD_DIM), k.view(TOKENS, KV_HEADS, HEAD_DIM)

    expected_q, expected_k = torch_rope(positions, *views(qkv))
    values = qkv[:, -KV_HEADS * HEAD_DIM:].clone()
    q, k = kernel_rope(positions, *views(qkv))  # rotated in place: views of qkv
    assert q.data_ptr() == qkv.data_ptr()
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)  # exact in every dtype
    assert torch.equal(qkv[:, -KV_HEADS * HEAD_DIM:], values)  # v untouched


@pytest.mark.parametrize("call, message", [
    (lambda x, w, o: torch.ops.tessera_cpu.rms_norm(x.double(), w.double(), 1e-5, o.double()),
     "float32, bfloat16 or float16 expected"),
    (lambda x, w, o: torch.ops.tessera_cpu.rms_norm(x[:, :-1], w, 1e-5, o), "rows of 768 contiguous elements"),
    (lambda x, w, o: torch.ops.tessera_cpu.rms_norm(x, w.half(), 1e-5, o), "must share a dtype"),
    (lambda x, w, o: torch.ops.tessera_cpu.silu_and_mul(x, o), "rows of 1536 contiguous elements"),
    (lambda x, w, o: torch.ops.tessera_cpu.rotary_embedding(
        x.view(-1, 12, 64), x.view(-1, 12, 64), torch.full((x.shape[0],), 4096), w[:128].view(2, 64),
        w[:128].view(2, 64)), "position 4096 outside the table"),
])
def test_bad_inputs_are_refused_with_a_message(call, message):
    x, w, o = torch.randn(TOKENS, HIDDEN), torch.ones(HIDDEN), torch.empty(TOKENS, HIDDEN)
    with pytest.raises(RuntimeError, match=message):
        call(x, w, o)


def _engine(path, dtype: str, backend: str) -> LLM:
    # A small token budget chunks the prompts, so steps mix decodes with prefill chunks.
    return LLM(str(path), dtype=dtype, attention_backend=backend, max_model_len=256, max_num_batched_tokens=32,
               kv_cache_memory_bytes=16 << 20, block_size=8)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _set_layer_kernels(llm: LLM, on: bool) -> None:
    for module in llm.engine_core.executor.runner.model.modules():
        if hasattr(module, "cpu_kernels"):
            module.cpu_kernels = on


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_gives_the_same_tokens_with_and_without_the_kernels(tiny_llama, dtype):
    with _engine(tiny_llama, dtype, "cpu") as llm:
        layers = llm.engine_core.executor.runner.model.model.layers
        assert all(layer.mlp.cpu_kernels and layer.input_layernorm.cpu_kernels for layer in layers)
        with_kernels = _greedy(llm)
        _set_layer_kernels(llm, False)
        assert _greedy(llm) == with_kernels


def test_prefix_cache_hits_leave_bf16_tokens_unchanged(tiny_llama):
    """bf16 on the cpu backend: the second pass over the prompts reads their prefixes from the
    cache, so each chunk attends over a different split of cached and new keys; the attention
    kernels give the same bits either way, so greedy tokens do not move even at near-ties (torch's
    SDPA, whose blocking follows the chunk, moved them: docs/attention.md)."""
    with _engine(tiny_llama, "bfloat16", "cpu") as llm:
        cold = _greedy(llm)
        hits_before = llm.stats.prefix_cache_hits
        warm = _greedy(llm)
        assert llm.stats.prefix_cache_hits - hits_before >= sum(len(p) for p in PROMPTS) // 2
    assert warm == cold


def test_the_engine_with_the_kernels_gives_hugging_faces_tokens(tiny_llama):
    """float32: the cpu backend (decode kernel and the layers' kernels), the
    torch backend (no kernels) and HF agree token for token."""
    with _engine(tiny_llama, "float32", "cpu") as llm:
        kernels = _greedy(llm)
    with _engine(tiny_llama, "float32", "torch") as llm:
        assert not llm.engine_core.executor.runner.model.model.layers[0].mlp.cpu_kernels
        assert _greedy(llm) == kernels
    reference = hf_greedy(tiny_llama, PROMPTS, [12] * len(PROMPTS), dtype=torch.float32)
    assert kernels == [r.token_ids for r in reference]
