"""More model families against Hugging Face, and KV-cache waste under pressure.

Mistral (1 KV head: the most extreme grouped-query attention) and a Llama
with llama3 rope scaling must match HF greedy decoding token for token, in
float64 where the comparison is well-posed.
"""

from __future__ import annotations

import pytest

from engine_pod import LLM, SamplingParams
from tests.engine_pod.hf_reference import assert_matches_hf, hf_greedy
from tests.engine_pod.prompts import parity_prompts

ENGINE_KW = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=64 << 20)

# Six prompts, lengths 1..200, crossing block boundaries.
_ALL = parity_prompts(seed=1)
PROMPTS = [_ALL[0], _ALL[5], _ALL[8], _ALL[15], _ALL[17], _ALL[22]]
MAX_TOKENS = [32, 8, 17, 24, 5, 32]


def test_prompt_set_shape():
    assert [len(p) for p in PROMPTS] == [1, 9, 17, 65, 127, 200]


@pytest.mark.parametrize("family", ["tiny_mistral", "tiny_llama3_rope"])
def test_greedy_matches_hf(request, family):
    path = request.getfixturevalue(family)
    ref = hf_greedy(path, PROMPTS, MAX_TOKENS)
    # Chunked prefill and a block size that does not divide the prompts, to
    # exercise paging too.
    llm = LLM(str(path), **ENGINE_KW, max_num_batched_tokens=64, block_size=8)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=0) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert_matches_hf(outputs, ref, PROMPTS, logprob_tol=1e-6)


def test_checkpoint_shapes(tiny_mistral, tiny_llama3_rope):
    """The premises of the parity tests: what each checkpoint exercises."""
    mistral = LLM(str(tiny_mistral), **ENGINE_KW).config.model.arch
    assert mistral.architecture == "MistralForCausalLM"
    assert mistral.num_key_value_heads == 1 < mistral.num_attention_heads
    llama3 = LLM(str(tiny_llama3_rope), **ENGINE_KW).config.model.arch
    assert llama3.rope_scaling is not None and llama3.rope_scaling["rope_type"] == "llama3"


def test_kv_waste_below_a_block_under_preemption(tiny_llama):
    block_size = 16
    prompts = parity_prompts(seed=2)
    prompts = [p[:120] for p in prompts]  # 32 prompts of 1..120 tokens
    llm = LLM(
        str(tiny_llama), dtype="float64", max_model_len=256, block_size=block_size,
        num_gpu_blocks=20, max_num_batched_tokens=64,
    )
    # Half greedy, half seeded sampling: both must survive preemption unchanged.
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if i % 2 else
        SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=12, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    stats = llm.stats
    assert stats.num_preemptions > 0
    assert stats.steps > sum(len(p) for p in prompts) // 64  # prompts were chunked
    assert 0 < stats.max_kv_waste_per_request < block_size
    # Preemption and chunking change neither greedy nor seeded results.
    reference = LLM(str(tiny_llama), dtype="float64", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    expected = reference.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert reference.stats.num_preemptions == 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
