"""CPU engines repack their projection weights once loaded
(engine_pod/model/parallel_layers.py), for oneDNN or, in float32 on AVX2
machines without AVX-512, for the cpu backend's own GEMM: same products, the
embedding left dense, and a dense fallback where neither can pack the dtype."""

from __future__ import annotations

import torch

from engine_pod import LLM
from engine_pod.attention.cpu_ops.build import load_cpu_ops
from engine_pod.distributed.parallel_state import single_rank_group
from engine_pod.model.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    pack_cpu_weights,
    split_shards,
)

GROUP = single_rank_group(torch.device("cpu"))


def _model(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.up = MergedColumnParallelLinear(48, split_shards(["gate", "up"], 64, GROUP), bias=bias)
    model.down = RowParallelLinear(64, 48, bias=bias, group=GROUP)
    model.embed = VocabParallelEmbedding(100, 48, GROUP)
    model.head = ParallelLMHead(100, 48, GROUP)
    for p in model.parameters():
        p.data.normal_()
    return model.requires_grad_(False)


def test_packed_layers_compute_the_dense_products():
    model = _model(bias=True)
    x = torch.randn(5, 48)
    ids = torch.tensor([3, 99, 0])
    dense = (model.up(x), model.down(torch.randn(5, 64).copy_(torch.ones(5, 64))), model.embed(ids),
             model.head.matmul(x), model.embed.matmul(x))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pack_cpu_weights(model) == 3  # up, down and the LM head; never the embedding
    assert model.up.packed and model.down.packed and model.head.packed and not model.embed.packed
    assert model.up.weight.layout == torch._mkldnn and model.embed.weight.layout == torch.strided
    packed = (model.up(x), model.down(torch.ones(5, 64)), model.embed(ids), model.head.matmul(x),
              model.embed.matmul(x))
    for a, b in zip(dense, packed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # The bias of the row-parallel layer is added once (after the all-reduce), as before packing.
    torch.testing.assert_close(model.down(torch.zeros(5, 64)), model.down.bias.expand(5, 48))
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == weight_bytes


def own_gemm_runs_here() -> bool:
    assert load_cpu_ops() is None
    return bool(torch.ops.tessera_cpu.linear_f32_supported())


def test_with_the_cpu_backends_kernels_float32_goes_to_its_gemm_where_it_runs():
    kind = "tessera" if own_gemm_runs_here() else "onednn"
    model = _model(bias=True)
    x = torch.randn(2, 5, 48)
    dense = (model.up(x), model.down(torch.ones(5, 64)), model.head.matmul(x))
    assert pack_cpu_weights(model, own_kernels=True) == 3
    assert model.up.packed == model.down.packed == model.head.packed == kind and not model.embed.packed
    if kind == "tessera":  # panels of 16 output features: the head's 100 rows padded to 112
        assert model.head.weight.shape == (7, 48, 16) and model.head.out_features == 100
    packed = (model.up(x), model.down(torch.ones(5, 64)), model.head.matmul(x))
    for a, b in zip(dense, packed):
        assert b.shape == a.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(model.down(torch.zeros(5, 64)), model.down.bias.expand(5, 48))


def test_a_dtype_onednn_cannot_pack_stays_dense():
    model = _model(bias=False).double()
    x = torch.randn(2, 48, dtype=torch.float64)
    before = model.up(x)
    assert pack_cpu_weights(model, own_kernels=True) == 0
    assert not model.up.packed and model.up.weight.layout == torch.strided
    assert torch.equal(model.up(x), before)


def test_a_cpu_engine_runs_packed_float32_and_dense_float64(tiny_llama):
    float32 = "tessera" if own_gemm_runs_here() else "onednn"
    for dtype, packed in (("float32", float32), ("float64", None)):
        model = LLM(str(tiny_llama), dtype=dtype, kv_cache_memory_bytes=16 << 20).engine_core.executor.runner.model
        layer = model.model.layers[0]
        assert layer.self_attn.qkv_proj.packed == packed and layer.mlp.down_proj.packed == packed
        assert not model.model.embed_tokens.packed
