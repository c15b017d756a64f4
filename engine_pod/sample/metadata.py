"""Per-step sampling inputs, built by the runner for the requests that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    # [B] rows of the logits, one per sampling request, in this order.
    temperature: torch.Tensor  # 0 marks greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [B]
    min_p: torch.Tensor | None  # [B]
    # row -> generator, for seeded requests
    generators: dict[int, torch.Generator]
    # Penalties (None when no row has any).
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_token_ids: torch.Tensor | None  # [B, max_out] padded with vocab_size
    prompt_token_mask: torch.Tensor | None  # [B, V] bool
    # [B, V] bool: token ids banned because min_tokens is not reached yet.
    min_tokens_mask: torch.Tensor | None
    # Largest k over rows that want logprobs; None if none does.
    max_num_logprobs: int | None
    # [B, ceil(V / 32)] int32 grammar masks (all bits set for unguided rows);
    # None when no row is guided.
    grammar_bitmask: torch.Tensor | None = None
