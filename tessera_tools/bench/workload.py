"""Seeded synthetic workloads shaped like ShareGPT: long-tailed prompt and
output lengths, prompts cut from real text so they tokenize like chat."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tessera_tools.fixtures.tokenizer import corpus_lines


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _text_tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return tokenizer.encode("\n".join(corpus_lines()))


def _long_tailed(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """Log-normal lengths, clipped: most are short, a few are long (ShareGPT's shape)."""
    return max(lo, min(hi, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


def sharegpt_like(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int = 128,
    max_prompt_len: int = 512,
    max_output_len: int = 256,
    seed: int = 0,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    tokens = _text_tokens(tokenizer)
    requests = []
    for _ in range(num_requests):
        prompt_len = _long_tailed(rng, 120, 0.9, 4, max_prompt_len)
        output_len = _long_tailed(rng, 60, 0.9, 1, max_output_len)
        start = rng.randrange(0, len(tokens) - prompt_len)
        requests.append(BenchRequest(tokens[start : start + prompt_len], output_len))
    return requests


def shared_prefix(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int = 64,
    prefix_len: int = 1024,
    suffix_len: int = 32,
    output_len: int = 32,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests that share one long prefix (a system prompt or a document)
    and differ in a short suffix."""
    rng = random.Random(seed)
    tokens = _text_tokens(tokenizer)
    start = rng.randrange(0, len(tokens) - prefix_len)
    prefix = tokens[start : start + prefix_len]
    requests = []
    for _ in range(num_requests):
        s = rng.randrange(0, len(tokens) - suffix_len)
        requests.append(BenchRequest(prefix + tokens[s : s + suffix_len], output_len))
    return requests


def copy_heavy(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int = 4,
    passage_len: int = 64,
    repeats: int = 3,
    output_len: int = 64,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts that repeat a passage of text several times (code edits,
    quoting, summaries of a document): the continuation tends to copy
    earlier text, which is what n-gram speculation drafts from."""
    rng = random.Random(seed)
    tokens = _text_tokens(tokenizer)
    requests = []
    for _ in range(num_requests):
        start = rng.randrange(0, len(tokens) - passage_len)
        requests.append(BenchRequest(tokens[start : start + passage_len] * repeats, output_len))
    return requests
