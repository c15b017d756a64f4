"""Counters of drafting and verification (vLLM's spec_decode metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    # Verification steps of one request that carried at least one draft.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def add(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens

    def take(self) -> SpecDecodeStats:
        """The counts so far, resetting them (one step's worth)."""
        out = SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: the accepted drafts plus the
        one token the target model always adds (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
