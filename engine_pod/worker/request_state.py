"""What the model runner keeps per request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_pod.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    # [V] bool of prompt tokens, built on first use by the repetition penalty.
    prompt_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
