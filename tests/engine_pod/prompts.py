"""Seeded prompt sets for the parity tests."""

from __future__ import annotations

import random

# Lengths 1..300 with block-boundary neighbours (8/16/32 multiples and +-1).
LENGTHS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65,
           100, 127, 128, 129, 150, 181, 200, 231, 255, 256, 257, 270, 285, 296, 299, 300]
MAX_TOKENS = [1, 64, 2, 17, 33, 5, 64, 16, 8, 40, 1, 24, 64, 3, 31, 48,
              12, 64, 20, 7, 56, 9, 64, 15, 28, 2, 44, 36, 11, 64, 19, 50]


def parity_prompts(vocab_lo: int = 5, vocab_hi: int = 6000, seed: int = 0) -> list[list[int]]:
    """32 token-id prompts; about half share one of three prefixes (40, 100
    and 170 tokens), so prefix caching gets hits."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_lo, vocab_hi) for _ in range(n)] for n in (40, 100, 170)]
    prompts = []
    for i, length in enumerate(LENGTHS):
        prefix = prefixes[i % 3] if i % 2 == 1 else []
        prefix = prefix[: max(0, length - 1)]
        tail = [rng.randrange(vocab_lo, vocab_hi) for _ in range(length - len(prefix))]
        prompts.append(prefix + tail)
    return prompts
