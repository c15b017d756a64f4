"""n-gram speculative decoding end to end: greedy outputs equal decoding
without speculation (and Hugging Face's) token for token, with chunked
prefill, prefix caching, preemption and tensor parallelism; drafts must
have been accepted for a test to mean anything.

Float64, as in the parity tests, so verifying k + 1 positions in one
forward cannot flip a near-tied greedy choice against one-at-a-time decoding.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine_pod import LLM, SamplingParams
from engine_pod.spec_decode.fallback import can_speculate
from tests.engine_pod.hf_reference import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
ENGINE_KW = dict(
    dtype="float64", max_model_len=256, kv_cache_memory_bytes=32 << 20, device="cpu",
    enable_prefix_caching=True, max_num_batched_tokens=32,
)


def copy_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    """A random head, then a phrase said several times: the continuation
    tends to repeat earlier text (and random-weight models fall into loops).
    Pairs share their head, so prefix caching gets hits."""
    rng = random.Random(seed)
    heads = [[rng.randrange(5, 6000) for _ in range(rng.randrange(17, 40))] for _ in range(n // 2)]
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(5, 6000) for _ in range(rng.randrange(3, 9))]
        prompts.append(heads[i // 2] + phrase * rng.randrange(2, 5))
    return prompts


PROMPTS = copy_prompts()
MAX_TOKENS = [40, 7, 33, 48, 1, 25, 48, 12]


def generate(path, prompts=PROMPTS, max_tokens=MAX_TOKENS, params=None, **kwargs):
    params = params or [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    with LLM(str(path), **{**ENGINE_KW, **kwargs}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0] for o in outputs], llm.stats


def assert_same(outputs, reference):
    for i, (got, want) in enumerate(zip(outputs, reference)):
        assert got.token_ids == want.token_ids, f"prompt {i} diverged"
        assert got.finish_reason == want.finish_reason


def assert_drafts_accepted(stats):
    """Drafts were accepted and, so the rollback ran too, some were rejected."""
    spec = stats.spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0, spec
    assert spec.mean_accepted_length > 1.0
    assert spec.num_accepted_tokens < spec.num_draft_tokens, spec


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return generate(tiny_llama)[0]


def test_greedy_equals_no_speculation_and_hf_with_chunked_prefill_and_prefix_caching(tiny_llama, reference):
    outputs, stats = generate(tiny_llama, speculative_config=SPEC)
    assert_same(outputs, reference)
    assert_drafts_accepted(stats)
    assert stats.prefix_cache_hits > 0
    # The oracle on the two longest outputs (HF decodes one prompt at a time).
    picked = [0, 3]
    hf = hf_greedy(tiny_llama, [PROMPTS[i] for i in picked], [MAX_TOKENS[i] for i in picked])
    for i, ref in zip(picked, hf):
        assert outputs[i].token_ids == ref.token_ids, f"prompt {i}: speculative output differs from HF"


def test_greedy_equals_no_speculation_under_preemption(tiny_llama, reference):
    # 18 blocks of 16 tokens for 8 requests of up to ~130 tokens.
    outputs, stats = generate(tiny_llama, speculative_config=SPEC, num_gpu_blocks=18, kv_cache_memory_bytes=None)
    assert_same(outputs, reference)
    assert stats.num_preemptions > 0
    assert_drafts_accepted(stats)


def test_greedy_equals_no_speculation_at_tp2(tiny_llama, reference):
    prompts, max_tokens = PROMPTS[:4], MAX_TOKENS[:4]
    outputs, stats = generate(tiny_llama, prompts, max_tokens, speculative_config=SPEC, tensor_parallel_size=2)
    assert_same(outputs, reference[:4])
    assert_drafts_accepted(stats)


def test_fallback_rules():
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9, seed=1), 0)
    assert not can_speculate(SamplingParams(repetition_penalty=1.2), 5)
    assert not can_speculate(SamplingParams(presence_penalty=0.5), 5)
    assert not can_speculate(SamplingParams(logprobs=0), 5)
    assert not can_speculate(SamplingParams(min_tokens=3), 2)
    assert can_speculate(SamplingParams(min_tokens=3), 3)


def test_requests_verification_cannot_serve_decode_plainly_beside_speculating_ones(tiny_llama):
    # Penalties, logprobs and unmet min_tokens decode without drafts, in the
    # same steps as a request that speculates: outputs (logprobs included)
    # are those of the plain engine.
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20),
    ]
    prompts = PROMPTS[:4]
    want, _ = generate(tiny_llama, prompts, params=params)
    got, stats = generate(tiny_llama, prompts, params=params, speculative_config=SPEC)
    assert_same(got, want)
    assert got[1].logprobs == want[1].logprobs
    assert_drafts_accepted(stats)


def test_seeded_sampling_with_drafts_is_reproducible_and_mixes_with_greedy(tiny_llama, reference):
    # Low temperature keeps the loops (and so the drafts) of the greedy runs.
    sampled = SamplingParams(temperature=0.3, top_k=20, seed=7, max_tokens=30)
    params = [sampled, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[1])]
    prompts = PROMPTS[:2]
    first, stats = generate(tiny_llama, prompts, params=params, speculative_config=SPEC)
    again, _ = generate(tiny_llama, prompts, params=params, speculative_config=SPEC)
    assert first[0].token_ids == again[0].token_ids and len(first[0].token_ids) == 30
    assert first[1].token_ids == reference[1].token_ids
    assert_drafts_accepted(stats)


@pytest.mark.parametrize("bad, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "lookup"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_field(tiny_llama, bad, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama), speculative_config=bad, **ENGINE_KW)


def test_engine_pod_exits_2_on_a_bad_speculative_config(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "tessera_tools.cli", "engine", "--model", str(tiny_llama), "--cpu-threads", "1",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}'],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "speculative_config.prompt_lookup_min" in proc.stderr


def test_guided_requests_speculate_within_their_grammar(tiny_llama):
    """Drafts of guided requests are cut to what the grammar accepts and each
    draft position is masked by the grammar's state after the drafts before
    it: outputs equal guided decoding without speculation, and follow the
    constraint. The regex repeats a phrase (n-gram drafts come from it) and
    then forbids the repetition, so drafts must be cut where it ends."""
    import re

    from engine_pod.structured_output import StructuredOutputsParams

    pattern = r"(ab ){6}[a-z]{1,3}\."
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["aa", "bb"]},
                                                        "minItems": 4, "maxItems": 6}},
              "required": ["tags"], "additionalProperties": False}
    constraints = [dict(regex=pattern), dict(json=schema)] * 3
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(**c))
              for c in constraints]
    prompts = PROMPTS[: len(params)]
    plain, _ = generate(tiny_llama, prompts, params=params)
    spec, stats = generate(tiny_llama, prompts, params=params, speculative_config=SPEC)
    assert_same(spec, plain)
    assert stats.spec_decode.num_accepted_tokens > 0, stats.spec_decode
    for out, constraint in zip(spec, constraints):
        assert out.finish_reason == "stop", out.text
        if "regex" in constraint:
            assert re.fullmatch(pattern, out.text), out.text
        else:
            assert len(json.loads(out.text)["tags"]) >= 4
