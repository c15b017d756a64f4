"""``speculative_config``: vLLM's names, validated once at engine build."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
# Beyond this the verification forward grows for drafts that rarely survive.
MAX_SPECULATIVE_TOKENS = 32


@dataclass
class SpeculativeConfig:
    """n-gram (prompt lookup) speculation.

    Each step, a decoding request's longest context suffix of
    ``prompt_lookup_min..prompt_lookup_max`` tokens that occurred earlier
    proposes the ``num_speculative_tokens`` tokens that followed it.
    """

    num_speculative_tokens: int
    """Drafts proposed per decoding request and step (at most 32)."""
    method: str = "ngram"
    """How drafts are proposed; only "ngram" (prompt lookup) so far."""
    prompt_lookup_min: int | None = None
    """Shortest context suffix that is looked up. vLLM's rule: either bound
    alone sets both; neither means 5..5."""
    prompt_lookup_max: int | None = None
    """Longest context suffix that is looked up (tried first)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        self._check_int("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                self._check_int(name, getattr(self, name))
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @staticmethod
    def _check_int(name: str, value: Any, upper: int | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if upper is not None and value > upper:
            raise ValueError(f"speculative_config.{name} must be <= {upper}, got {value}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From ``LLM(speculative_config=...)`` or ``--speculative-config JSON``;
        None (or an empty dict) turns speculation off."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object / dict, got {type(value).__name__}")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)
