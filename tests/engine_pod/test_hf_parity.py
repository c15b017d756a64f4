"""Greedy outputs equal Hugging Face's token for token under every engine
feature (docs/architecture.md, invariant 2). Float64 makes the comparison well-posed:
in float32, different batchings round differently and flip near-ties."""

from __future__ import annotations

import os

import pytest

from engine_pod import LLM, SamplingParams
from tests.engine_pod.hf_reference import assert_matches_hf, hf_greedy
from tests.engine_pod.prompts import MAX_TOKENS, parity_prompts

PROMPTS = parity_prompts()
# The engine's device; CI runs on CPU, a GPU machine sets TESSERA_TEST_DEVICE=cuda.
DEVICE = os.environ.get("TESSERA_TEST_DEVICE", "cpu")
FAMILIES = ["tiny_llama", "tiny_qwen2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    path = request.getfixturevalue(request.param)
    return path, hf_greedy(path, PROMPTS, MAX_TOKENS)


def _run(path, priorities=None, **engine_kwargs):
    kwargs = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=64 << 20, device=DEVICE)
    kwargs.update(engine_kwargs)
    llm = LLM(str(path), **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=0) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, priority=priorities)
    return llm, outputs


def _assert_parity(outputs, reference):
    assert_matches_hf(outputs, reference, PROMPTS, logprob_tol=1e-3)


def test_prefix_caching_off(family):
    path, ref = family
    llm, outputs = _run(path, enable_prefix_caching=False)
    _assert_parity(outputs, ref)
    assert llm.stats.prefix_cache_hits == 0


def test_prefix_caching_on_with_shared_prefixes(family):
    path, ref = family
    llm, outputs = _run(path, enable_prefix_caching=True)
    _assert_parity(outputs, ref)
    assert llm.stats.prefix_cache_hits > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0


@pytest.mark.parametrize("budget", [16, 64, 2048])
def test_token_budgets(family, budget):
    path, ref = family
    llm, outputs = _run(path, max_num_batched_tokens=budget)
    _assert_parity(outputs, ref)
    if budget == 16:
        assert llm.stats.steps > sum(len(p) for p in PROMPTS) // 16  # prompts were chunked


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(family, block_size):
    path, ref = family
    _, outputs = _run(path, block_size=block_size)
    _assert_parity(outputs, ref)


def test_small_pool_preempts(family):
    path, ref = family
    # 40 blocks of 16 = 640 slots for 32 prompts of up to 300 + 64 tokens.
    llm, outputs = _run(path, num_gpu_blocks=40, max_num_batched_tokens=256)
    _assert_parity(outputs, ref)
    assert llm.stats.num_preemptions > 0


def test_priority_scheduling(family):
    path, ref = family
    priorities = [(i * 7) % 5 - 2 for i in range(len(PROMPTS))]
    llm, outputs = _run(
        path, priorities, scheduling_policy="priority", num_gpu_blocks=48, max_num_batched_tokens=128
    )
    _assert_parity(outputs, ref)
    assert llm.stats.num_preemptions > 0
