"""Sampling parameters with vLLM's names and semantics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.sampling_limits import ENGINE_RANGES, check_range
from tessera.structured_output import StructuredOutputsParams

_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample the output of one request (vLLM names and meanings).

    ``temperature == 0`` means greedy. ``top_k`` of -1 or 0 disables top-k;
    ``top_p == 1`` and ``min_p == 0`` disable those filters. ``stop_token_ids``
    end generation and stay in the output token ids; ``stop`` strings end it and
    are cut from the text. ``logprobs=k`` returns the sampled token's logprob and
    the top-k alternatives for every output token; ``prompt_logprobs=k`` the same for every
    prompt token after the first (each one's logprob given the tokens before it: a prompt's
    perplexity), computed, never read from the prefix cache. ``structured_outputs``
    constrains the output to a JSON schema, regex, choice or grammar.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    # Filled in by the engine: every token id that ends the request.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        """Types here; the ranges are tessera.sampling_limits' (the gateway's
        are those or tighter)."""
        def fail(field_name: str, msg: str) -> None:
            raise ValueError(f"SamplingParams.{field_name}: {msg}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(name, f"must be a finite number, got {value!r}")
        for name in ("n", "max_tokens", "min_tokens", "top_k", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if (value is not None or name == "n") and (isinstance(value, bool) or not isinstance(value, int)):
                fail(name, f"must be an integer, got {value!r}")
        for name in ENGINE_RANGES:
            check_range(name, getattr(self, name), ENGINE_RANGES, where="SamplingParams.")
        # The offline API's only, so far (the gateway does not take it): logprobs' range.
        check_range("prompt_logprobs", self.prompt_logprobs, {"prompt_logprobs": ENGINE_RANGES["logprobs"]},
                    where="SamplingParams.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", f"must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def resolve_stop_token_ids(self, eos_token_ids: set[int]) -> None:
        """Fix the set of token ids that end this request (EOS unless ignore_eos)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= eos_token_ids
        self.all_stop_token_ids = ids

    def clone_for_child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n parallel samples: n=1, and a distinct
        seed per child so seeded samples differ yet stay reproducible."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, all_stop_token_ids=set(self.all_stop_token_ids))
