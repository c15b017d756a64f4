"""KV blocks never cross adapters: the same prompt on two adapters and on the
base model gets no prefix hit, in the engine's own cache and through Redis,
while the same prompt on the same adapter does."""

from __future__ import annotations

import random

import pytest

from engine_pod import LLM, LoRARequest, SamplingParams
from kv_store.block_hash import hash_request_tokens

ENGINE_KW = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=16 << 20, enable_lora=True,
                 max_loras=2, max_cpu_loras=3)
PROMPT = [random.Random(3).randrange(5, 6000) for _ in range(100)]  # 6 full blocks of 16


def _generate(llm, lora):
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=4),
                       lora_request=lora)[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


@pytest.fixture
def loras(tiny_llama_loras):
    return [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(tiny_llama_loras)]


def test_the_device_cache_is_per_adapter(tiny_llama, loras):
    llm = LLM(str(tiny_llama), **ENGINE_KW)
    assert _generate(llm, loras[0])[0] == 0
    assert _generate(llm, loras[1])[0] == 0  # another adapter: no hit
    assert _generate(llm, None)[0] == 0  # the base model: no hit
    assert _generate(llm, loras[0])[0] == 96  # the same adapter again: every full block
    assert _generate(llm, None)[0] == 96
    assert _generate(llm, loras[1])[0] == 96


def test_the_adapter_enters_the_first_block_hash_only():
    """Its identity (the fingerprint) separates the chain at block 0; every
    later block differs through its parent."""
    base = hash_request_tokens(PROMPT, 16)
    one = hash_request_tokens(PROMPT, 16, adapter="aa" * 32)
    other = hash_request_tokens(PROMPT, 16, adapter="bb" * 32)
    assert len({*base, *one, *other}) == 3 * len(base)
    salted = hash_request_tokens(PROMPT, 16, cache_salt="tenant", adapter="aa" * 32)
    assert not set(salted) & set(one)


def test_redis_carries_an_adapters_blocks_to_that_adapter_only(tiny_llama, loras, redis_server):
    """A second engine reads the first one's blocks from Redis for the same
    adapter, never for another adapter or the base model."""
    writer = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)
    _, written = _generate(writer, loras[0])
    writer.engine_core.kv_store.flush()
    reader = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)
    assert _generate(reader, loras[1])[0] == 0
    assert _generate(reader, None)[0] == 0
    assert reader.stats.external_prefix_hits == 0
    cached, tokens = _generate(reader, loras[0])
    assert cached == 96 and tokens == written
    assert reader.stats.external_prefix_hits == 96


def test_one_name_with_other_weights_is_another_adapter(tiny_llama, tiny_llama_loras, tmp_path):
    """KV follows the adapter's bytes, not its name: a second engine serving
    other weights under the same name and id shares no block with the first."""
    import shutil

    copy = tmp_path / "adapter"
    shutil.copytree(tiny_llama_loras[0], copy)
    first = LLM(str(tiny_llama), **ENGINE_KW)
    request = LoRARequest("same-name", 1, str(copy))
    first.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1), lora_request=request)
    shutil.rmtree(copy)
    shutil.copytree(tiny_llama_loras[2], copy)
    second = LLM(str(tiny_llama), **ENGINE_KW)
    second.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1), lora_request=request)
    spec_first = first.processor.process_lora(request)
    spec_second = second.processor.process_lora(request)
    assert spec_first.fingerprint != spec_second.fingerprint
    assert not set(hash_request_tokens(PROMPT, 16, adapter=spec_first.fingerprint)) & set(
        hash_request_tokens(PROMPT, 16, adapter=spec_second.fingerprint)
    )
