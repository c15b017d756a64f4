"""The real model (SmolLM2-135M-Instruct, float32) against Hugging Face, the oracle.

The base run is 64 prompts x 64 greedy tokens (questions asked through the chat template, and
paragraph openings of the shipped text), checked position by position against HF's choice given
the same prefix (tessera_tools/bench/hf_parity.py: equal choices everywhere means HF's own greedy
generation is the same sequence). Each engine feature that must not change the output then
runs the same 64 prompts for fewer tokens (what the feature changes is prefill, scheduling or
drafting; the suite's time is bounded) and must give the base run's tokens. A feature that
changes a greedy token here is a bug until shown to be a near-tie, with both margins.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_pod import LLM, SamplingParams
from tessera_tools.fixtures.quality import parity_prompts
from tessera_tools.bench.hf_parity import greedy_divergences

BASE_TOKENS, FEATURE_TOKENS = 64, 16
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _params(tokens: int, logprobs: int | None = None) -> SamplingParams:
    # The base run asks for two logprobs (both margins where a token parts); the features ask
    # for none, since a request with logprobs is never drafted for (spec_decode/fallback.py).
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return parity_prompts(AutoTokenizer.from_pretrained(str(smollm2)), 64)


@pytest.fixture(scope="module")
def hf_model(smollm2):
    return AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base(smollm2, prompts):
    """The engine's base run, and the engine (kept for the prefix-cache rerun)."""
    llm = LLM(str(smollm2), dtype="float32", max_num_seqs=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(BASE_TOKENS, logprobs=2))
    yield llm, outputs
    llm.shutdown()


def test_base_run_equals_hugging_face_token_for_token(prompts, base, hf_model):
    _, outputs = base
    assert [len(o.outputs[0].token_ids) for o in outputs] == [BASE_TOKENS] * len(prompts)
    divergences = greedy_divergences(hf_model, prompts, outputs)
    assert divergences == [], "\n".join(map(str, divergences))


def test_chat_answer_is_hugging_faces_and_right(smollm2, base, hf_model):
    llm, _ = base
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == theirs  # HF stops at the generation config's EOS as the engine does
    assert ours.finish_reason == "stop" and "Paris" in ours.text, ours.text


def _base_prefix(base, tokens: int, count: int = 64) -> list[list[int]]:
    return [o.outputs[0].token_ids[:tokens] for o in base[1][:count]]


def test_prefix_cache_hits_change_nothing(prompts, base):
    llm, _ = base
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(FEATURE_TOKENS))
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == _base_prefix(base, FEATURE_TOKENS)


# Each feature's engine settings, the prompts it runs and their tokens (a budget of 16 tokens a
# step takes ~170 steps to prefill all 64 prompts: it runs the first 16, every kind among them).
FEATURES = {
    "chunked prefill, budget 16": ({"max_num_batched_tokens": 16}, 16, 8),
    "chunked prefill, budget 64": ({"max_num_batched_tokens": 64}, 64, FEATURE_TOKENS),
    "preemption in a small block pool": ({"num_gpu_blocks": 48, "kv_cache_memory_bytes": None, "max_model_len": 256},
                                         64, FEATURE_TOKENS),
    "n-gram speculative decoding": ({"speculative_config": SPEC}, 64, FEATURE_TOKENS),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_changes_no_greedy_token(feature, smollm2, prompts, base):
    settings, count, tokens = FEATURES[feature]
    with LLM(str(smollm2), dtype="float32", max_num_seqs=64, **settings) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:count]], _params(tokens))
        totals = llm.stats
    if "preemption" in feature:
        assert totals.num_preemptions > 0
    if "speculative" in feature:
        assert totals.spec_decode.num_draft_tokens > 0
    got = [o.outputs[0].token_ids for o in outputs]
    want = _base_prefix(base, tokens, count)
    parted = [(i, next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)) for i, (g, w) in enumerate(zip(got, want))
              if g != w]
    assert parted == [], f"{feature}: (prompt, first differing position): {parted}"
