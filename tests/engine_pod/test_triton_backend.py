"""End to end: the offline LLM on the triton attention backend (on CPU under
TRITON_INTERPRET=1, set by tests/conftest.py) gives the torch backend's
greedy tokens, through a prefix-cache hit, a chunked prefill and steps that
mix decodes with a prefill chunk."""

from __future__ import annotations

import random

from engine_pod import LLM, SamplingParams

ENGINE_KW = dict(
    dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20, block_size=8,
    # A small budget chunks the long prompt, so decodes share steps with it.
    max_num_batched_tokens=16,
)
MAX_TOKENS = 4


def _prompts() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(0)
    first = [rng.randrange(5, 6000) for _ in range(20)]
    # Shares 19 tokens with the first prompt: two full cached blocks.
    shared = first[:19] + [rng.randrange(5, 6000) for _ in range(5)]
    long = [rng.randrange(5, 6000) for _ in range(40)]
    return first, [shared, long]


def _greedy(path, backend: str) -> tuple[list[list[int]], int]:
    first, rest = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(str(path), attention_backend=backend, **ENGINE_KW) as llm:
        # The first request's blocks stay cached for the second call.
        outputs = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        outputs += llm.generate([{"prompt_token_ids": p} for p in rest], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.stats.prefix_cache_hits


def test_triton_backend_matches_torch_backend(tiny_llama):
    triton_tokens, triton_hits = _greedy(tiny_llama, "triton")
    torch_tokens, _ = _greedy(tiny_llama, "torch")
    assert triton_hits > 0
    assert all(len(t) == MAX_TOKENS for t in torch_tokens)
    assert triton_tokens == torch_tokens
