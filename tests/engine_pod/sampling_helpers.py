"""Shared by the end-to-end sampling tests (test_sampling*.py): one offline
engine on the 'tiny' checkpoint per test module, and prompt builders."""

from __future__ import annotations

import random

import pytest

from engine_pod import LLM, SamplingParams

ENGINE_KW = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=64 << 20)
EOS_IDS = {1, 3}  # <|end_of_text|> (tokenizer EOS), <|im_end|> (generation_config)
BLOCK_SIZE = 16

# Prompts whose greedy continuation on the 'tiny' checkpoint starts with EOS,
# found once by a greedy search over random 2- and 4-token prompts. The tests
# check this premise first, so a changed fixture fails loudly, not silently.
EOS_PROMPTS = [[4476, 5079], [1192, 710, 1654, 4192]]


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 6000) for _ in range(n)] for n in lengths]


def token_prompt(ids: list[int]) -> dict:
    return {"prompt_token_ids": ids}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), **ENGINE_KW)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def greedy_output(llm, prompt, max_tokens, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0].outputs[0]
