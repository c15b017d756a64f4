"""The token ids a simulated engine emits: a function of the prompt and of
the position alone, so a test (or a benchmark checking correctness through
the gateway) knows every output in advance, whatever the batch, the chunk
sizes, the preemptions or the pod that served the request."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence

_MASK64 = (1 << 64) - 1


def prompt_seed(prompt_token_ids: Sequence[int]) -> int:
    """A 64-bit seed that changes with any token of the prompt."""
    return int.from_bytes(hashlib.blake2b(array("q", prompt_token_ids).tobytes(), digest_size=8).digest(), "little")


def _splitmix64(x: int) -> int:
    # The SplitMix64 finaliser: cheap, and neighbouring positions give unrelated values.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def simulated_token(seed: int, position: int, vocab_size: int, eos_token_ids: Collection[int]) -> int:
    """The token at sequence ``position`` (0-based over prompt then output).
    Never an EOS id (the next id up is taken), so a request runs to its
    max_tokens as a benchmark expects; stop_token_ids still stop it."""
    token = _splitmix64(seed ^ position) % vocab_size
    for _ in range(vocab_size):
        if token not in eos_token_ids:
            return token
        token = (token + 1) % vocab_size
    raise ValueError("every token id of the vocabulary is an EOS id")


def simulated_output(prompt_token_ids: Sequence[int], num_tokens: int, vocab_size: int,
                     eos_token_ids: Collection[int]) -> list[int]:
    """The first ``num_tokens`` output ids of a prompt."""
    seed, start = prompt_seed(prompt_token_ids), len(prompt_token_ids)
    return [simulated_token(seed, start + i, vocab_size, eos_token_ids) for i in range(num_tokens)]
