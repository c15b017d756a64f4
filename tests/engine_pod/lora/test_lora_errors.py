"""Every way an adapter or a LoRA setting can be wrong is a ValueError that
names the cause, raised before anything runs; nothing crashes or hangs."""

from __future__ import annotations

import json
import shutil

import pytest

from engine_pod import LLM, LoRARequest, SamplingParams
from engine_pod.config import create_engine_config
from engine_pod.lora.adapter import inspect_adapter, load_adapter_weights
from engine_pod.model.hf_config import load_arch_config
from tessera_tools.fixtures.make_lora import make_lora_adapter

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20,
               enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture
def adapter(tiny_llama_loras, tmp_path):
    """A writable copy of the rank-8 adapter."""
    return shutil.copytree(tiny_llama_loras[0], tmp_path / "adapter")


def _refused(llm, path, match, lora_id=100):
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPT], SamplingParams(max_tokens=1), lora_request=LoRARequest("bad", lora_id, str(path)))


def _edit_config(path, **changes):
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


def test_a_rank_above_max_lora_rank(llm, tiny_llama_loras):
    _refused(llm, tiny_llama_loras[2], r"rank r=16 exceeds this engine's max_lora_rank=8")


def test_a_missing_folder_or_file(llm, adapter, tmp_path):
    _refused(llm, tmp_path / "nowhere", "no such adapter folder")
    (adapter / "adapter_model.safetensors").unlink()
    _refused(llm, adapter, "adapter_model.safetensors is missing")
    (adapter / "adapter_model.bin").write_bytes(b"pickle")
    _refused(llm, adapter, "not the pickled adapter_model.bin")
    (adapter / "adapter_config.json").unlink()
    _refused(llm, adapter, "adapter_config.json is missing")


@pytest.mark.parametrize(("text", "match"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"r": 0, "target_modules": ["q_proj"]}', "r must be a positive integer"),
    ('{"r": "8", "target_modules": ["q_proj"]}', "r must be a positive integer"),
    ('{"r": 8, "lora_alpha": "x", "target_modules": ["q_proj"]}', "lora_alpha must be a number"),
    ('{"r": 8, "target_modules": ".*proj"}', "as a pattern"),
    ('{"r": 8, "target_modules": []}', "non-empty list"),
    ('{"r": 8, "peft_type": "IA3", "target_modules": ["q_proj"]}', "only LORA adapters"),
])
def test_a_malformed_config(llm, adapter, text, match):
    (adapter / "adapter_config.json").write_text(text)
    _refused(llm, adapter, match)


@pytest.mark.parametrize(("changes", "match"), [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
])
def test_peft_options_the_engine_does_not_implement(llm, adapter, changes, match):
    _edit_config(adapter, **changes)
    _refused(llm, adapter, match)


def test_target_modules_the_model_does_not_have(llm, adapter):
    _edit_config(adapter, target_modules=["q_proj", "c_attn", "embed_tokens"])
    _refused(llm, adapter, r"target_modules \['c_attn', 'embed_tokens'\] are not projections of this model")


def test_an_adapter_of_another_base_model(llm, tiny_llama, tmp_path):
    """Trained on a base of another width: the shapes say so."""
    other_base = tmp_path / "other-base"
    other_base.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config.update(hidden_size=128, intermediate_size=344, head_dim=32)
    (other_base / "config.json").write_text(json.dumps(config))
    adapter = make_lora_adapter(other_base, tmp_path / "other-adapter", rank=4)
    _refused(llm, adapter, "a mismatch means an adapter of another base model")
    config.update(hidden_size=256, intermediate_size=688, head_dim=64, num_hidden_layers=6)
    (other_base / "config.json").write_text(json.dumps(config))
    deeper = make_lora_adapter(other_base, tmp_path / "deeper-adapter", rank=4)
    _refused(llm, deeper, "the model has 4 layers", lora_id=101)


def test_a_truncated_or_foreign_weights_file(llm, adapter):
    weights = adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _refused(llm, adapter, "outside the file")
    weights.write_bytes(b"\xff" * 16)
    _refused(llm, adapter, "bad header length")
    _edit_config(adapter, target_modules=["q_proj"])  # the file holds factors of seven projections
    weights.write_bytes(data)
    _refused(llm, adapter, "not in its target_modules")


def test_one_id_names_one_adapter(llm, tiny_llama_loras):
    llm.generate([PROMPT], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 7, str(tiny_llama_loras[0])))
    with pytest.raises(ValueError, match="lora_int_id 7 already names adapter 'a'"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1),
                     lora_request=LoRARequest("b", 7, str(tiny_llama_loras[1])))


def test_a_bad_adapter_in_a_list_adds_nothing(llm, tiny_llama_loras, tmp_path):
    good = LoRARequest("good", 8, str(tiny_llama_loras[0]))
    with pytest.raises(ValueError, match="no such adapter folder"):
        llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=1),
                     lora_request=[good, LoRARequest("gone", 9, str(tmp_path / "gone"))])
    assert not llm.engine_core.has_unfinished_requests()


@pytest.mark.parametrize(("request_args", "match"), [
    (("", 1, "/x"), "lora_name must be a non-empty string"),
    (("a", 0, "/x"), "lora_int_id must be a positive integer"),
    (("a", True, "/x"), "lora_int_id must be a positive integer"),
    (("a", 1, ""), "lora_path must be a non-empty string"),
])
def test_a_malformed_lora_request(request_args, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(*request_args)


def test_an_engine_without_enable_lora(tiny_llama, tiny_llama_loras):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="started without enable_lora"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1),
                     lora_request=LoRARequest("a", 1, str(tiny_llama_loras[0])))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_loras=0), "max_loras must be a positive integer"),
    (dict(max_lora_rank=7), "max_lora_rank must be one of"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be an integer at least max_loras \(4\)"),
])
def test_bad_lora_settings(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_engine_config(tiny_llama, enable_lora=True, **kwargs)


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_a_read_timeout_must_be_positive(seconds):
    from engine_pod.lora.config import LoRAConfig

    with pytest.raises(ValueError, match="read_timeout_s must be > 0"):
        LoRAConfig(read_timeout_s=seconds)


def test_files_changed_after_the_check_are_not_loaded(tiny_llama, adapter, tiny_llama_loras):
    """The bytes read must be the bytes checked: otherwise KV would be
    cached under the first files' identity for other weights."""
    import torch

    spec = inspect_adapter(LoRARequest("a", 1, str(adapter)), load_arch_config(tiny_llama), 16)
    assert load_adapter_weights(spec, torch.float32).factors
    shutil.copy(tiny_llama_loras[1] / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="its files changed after it was checked"):
        load_adapter_weights(spec, torch.float32)
