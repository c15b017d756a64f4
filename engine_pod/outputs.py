"""What the offline API returns (vLLM's RequestOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per output token: token id -> Logprob (sampled token and top-k).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache (the first sample's count).
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: None for the first prompt token (nothing precedes it),
    # then per prompt token its id -> Logprob and the top-k's (vLLM's shape); else None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
