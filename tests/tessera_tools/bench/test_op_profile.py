"""`tessera bench throughput --profile-ops`: operators by kind, from torch's profiler."""

from __future__ import annotations

import json

import pytest
import torch

from tessera_tools.bench.op_profile import OTHER, category, profile_ops


@pytest.mark.parametrize("name, expected", [
    ("mkldnn::_linear_pointwise", "gemm"), ("aten::addmm", "gemm"), ("aten::mm", "gemm"),
    ("tessera_cpu::paged_decode", "attention"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::index_copy_", "kv cache writes and gathers"), ("aten::argmax", "sampling"),
    ("aten::mul", "norms, rotary, activations, casts"), ("aten::_to_copy", "norms, rotary, activations, casts"),
    ("aten::empty", OTHER),
    # vLLM's CPU operators
    ("_C::onednn_mm", "gemm"), ("_C::cpu_attention_with_kv_cache", "attention"),
    ("_C::cpu_attn_reshape_and_cache", "kv cache writes and gathers"),
    ("vllm::unified_kv_cache_update", "kv cache writes and gathers"),
    ("## Call CompiledFxGraph None ##", "compiled graphs"), ("_C::greedy_argmax", "sampling"),
])
def test_operators_fall_into_the_issues_categories(name, expected):
    assert category(name) == expected


def test_the_categories_add_up_to_the_operators_self_time():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    profile = profile_ops(lambda: [(a @ b) * 2.0 for _ in range(20)], top=3)
    by = profile["by_category_s"]
    assert by["gemm"] > 0 and by["norms, rotary, activations, casts"] > 0
    assert sum(by.values()) == pytest.approx(profile["operators_s"])
    assert 0 < profile["operators_s"] <= profile["wall_s"] and len(profile["top_operators"]) == 3


def test_the_command_reports_the_engines_operators(tiny_llama, tmp_path):
    from tessera_tools.cli import main

    out = tmp_path / "ops.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--num-requests", "4", "--max-prompt-len", "32",
                 "--max-output-len", "4", "--kv-cache-gib", "1", "--profile-ops", "--output", str(out)]) == 0
    ops = json.loads(out.read_text())["operators"]
    assert ops["by_category_s"]["gemm"] > 0 and ops["by_category_s"]["attention"] > 0
