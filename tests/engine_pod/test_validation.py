"""Bad input raises a clear ValueError naming the field, before anything runs."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine_pod import LLM, SamplingParams

ENGINE_KW = dict(dtype="float64", max_model_len=128, kv_cache_memory_bytes=16 << 20)
VOCAB = 8192


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), **ENGINE_KW)


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine_core.has_unfinished_requests()
    assert llm.output_processor._children == {}


# -- SamplingParams ------------------------------------------------------------

@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_k", -2),
        ("n", 0),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", 1.5),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_tokens=1), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-3), dict(top_k=-1),
     dict(top_k=0), dict(top_k=1), dict(n=1), dict(max_tokens=None), dict(min_tokens=4, max_tokens=4)],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


# -- prompts -------------------------------------------------------------------

def test_empty_text_prompt(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", SamplingParams(max_tokens=1))
    _assert_idle(llm)


def test_empty_token_prompt(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=1))
    _assert_idle(llm)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [10] * 129}, SamplingParams(max_tokens=1))
    long_text = " ".join(["word"] * 400)
    assert len(llm.get_tokenizer().encode(long_text)) > 128
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(long_text, SamplingParams(max_tokens=1))
    _assert_idle(llm)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 100, -1])
def test_token_id_outside_vocabulary(llm, bad):
    with pytest.raises(ValueError, match="prompt_token_ids") as info:
        llm.generate({"prompt_token_ids": [5, 6, bad]}, SamplingParams(max_tokens=1))
    assert str(bad) in str(info.value)
    _assert_idle(llm)


@pytest.mark.parametrize("bad", [5.0, "7", None, True])
def test_token_id_of_wrong_type(llm, bad):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [5, bad]}, SamplingParams(max_tokens=1))


def test_prompt_of_wrong_shape(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "hi"}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": "hello"}, SamplingParams(max_tokens=1))


def test_stop_token_id_outside_vocabulary(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hello", SamplingParams(max_tokens=1, stop_token_ids=[VOCAB]))


def test_bad_prompt_in_a_list_adds_nothing(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    prompts = [good, good, {"prompt_token_ids": [5, VOCAB]}, good]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    _assert_idle(llm)
    # Bad params in the middle of a list: nothing added either.
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, stop_token_ids=[VOCAB + 1])]
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([good, good], params)
    _assert_idle(llm)
    # The engine is still usable and runs exactly the next batch.
    outputs = llm.generate([good, good], SamplingParams(max_tokens=2, temperature=0.0))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]
    _assert_idle(llm)


def test_sampling_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=1)] * 2)
    _assert_idle(llm)


def test_sampling_params_of_wrong_type(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate("hi", [dict(max_tokens=1)])


def test_nonzero_priority_needs_priority_policy(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[0, 1])
    _assert_idle(llm)


def test_priority_length_mismatch(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[0])


def test_zero_priorities_are_fine_with_fcfs(llm):
    out = llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[0, 0])
    assert len(out) == 2


# -- engine configuration ------------------------------------------------------

@pytest.mark.parametrize("block_size", [0, -16, 512])
def test_bad_block_size(tiny_llama, block_size):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_llama), **{**ENGINE_KW, "block_size": block_size})


def test_pool_smaller_than_one_sequence(tiny_llama):
    # 7 blocks of 16 = 112 slots < max_model_len 128.
    with pytest.raises(ValueError, match="num_gpu_blocks") as info:
        LLM(str(tiny_llama), **{**ENGINE_KW, "num_gpu_blocks": 7})
    assert "max_model_len" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_gpu_blocks=0), "num_gpu_blocks"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=4096), "max_model_len"),  # beyond max_position_embeddings (2048)
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
        (dict(attention_backend="flash"), "attention_backend"),
        (dict(dtype="float8"), "dtype"),
        (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 4 heads
    ],
)
def test_bad_engine_arguments(tiny_llama, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama), **{**ENGINE_KW, **kwargs})


# -- checkpoints ---------------------------------------------------------------

@pytest.fixture
def ckpt_copy(tiny_llama, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, dst)
    return dst


def test_unsupported_architecture(ckpt_copy):
    cfg_file = ckpt_copy / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures") as info:
        LLM(str(ckpt_copy), **ENGINE_KW)
    assert "GPT2LMHeadModel" in str(info.value)


def test_missing_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(ckpt_copy), **ENGINE_KW)


def test_config_missing_required_field(ckpt_copy):
    cfg_file = ckpt_copy / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["num_hidden_layers"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LLM(str(ckpt_copy), **ENGINE_KW)


def _set_rope_scaling(ckpt, scaling):
    cfg_file = ckpt / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rope_scaling"] = scaling
    cfg_file.write_text(json.dumps(cfg))


def test_unsupported_rope_scaling_in_config(ckpt_copy):
    # A well-formed longrope config (transformers accepts it), which the engine does not implement.
    half = 64 // 2
    _set_rope_scaling(ckpt_copy, {
        "rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 1024,
        "short_factor": [1.0] * half, "long_factor": [2.0] * half,
    })
    with pytest.raises(ValueError, match="rope_scaling") as info:
        LLM(str(ckpt_copy), **ENGINE_KW)
    assert "longrope" in str(info.value)


def test_malformed_rope_scaling_in_config_is_a_value_error(ckpt_copy):
    _set_rope_scaling(ckpt_copy, {"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling"):
        LLM(str(ckpt_copy), **ENGINE_KW)


@pytest.mark.parametrize(
    "tensor",
    ["model.layers.2.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
     "model.layers.3.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"],
)
def test_missing_weight_tensor(ckpt_copy, tensor):
    weights_file = ckpt_copy / "model.safetensors"
    weights = load_file(str(weights_file))
    assert tensor in weights
    del weights[tensor]
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weight") as info:
        LLM(str(ckpt_copy), **ENGINE_KW)
    assert tensor in str(info.value)


def test_wrong_weight_shape(ckpt_copy):
    weights_file = ckpt_copy / "model.safetensors"
    weights = load_file(str(weights_file))
    name = "model.layers.1.self_attn.o_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj"):
        LLM(str(ckpt_copy), **ENGINE_KW)


def test_no_weights_at_all(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(ckpt_copy), **ENGINE_KW)
