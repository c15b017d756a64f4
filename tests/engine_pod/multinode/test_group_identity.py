"""The settings the nodes of a multi-node engine must share (group_identity.py)."""

from __future__ import annotations

from engine_pod.config import create_engine_config
from engine_pod.executor.group_identity import group_identity, identity_differences


def _identity(model, **kw) -> dict[str, str]:
    return group_identity(create_engine_config(str(model), device="cpu", kv_cache_memory_bytes=16 << 20, **kw))


def test_the_same_settings_agree_and_each_difference_is_named(tiny_llama, tiny_qwen2):
    leader = _identity(tiny_llama, dtype="float32", max_model_len=256)
    assert identity_differences(leader, _identity(tiny_llama, dtype="float32", max_model_len=256)) == []
    assert identity_differences(leader, _identity(tiny_llama, dtype="float64", max_model_len=256)) == [
        "dtype: torch.float32 != torch.float64"]
    other_model = identity_differences(leader, _identity(tiny_qwen2, dtype="float32", max_model_len=256))
    assert any(d.startswith("model config.json sha256: ") for d in other_model)
    layout = identity_differences(_identity(tiny_llama, pipeline_parallel_size=2),
                                  _identity(tiny_llama, pipeline_parallel_size=2, tensor_parallel_size=2))
    assert layout == ["tensor_parallel_size: 1 != 2"]


def test_a_setting_only_one_side_has_is_a_difference():
    assert identity_differences({"a": "1"}, {"a": "1", "b": "2"}) == ["b: (absent) != 2"]
