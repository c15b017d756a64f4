"""The sampler: logits of the sampling rows in, one token (and logprobs) per row out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_pod.sample.metadata import SamplingMetadata
from engine_pod.sample.ops import (
    apply_grammar_bitmask,
    apply_penalties,
    apply_temperature_and_truncation,
    random_sample,
)


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B]
    # [B, k + 1]: the sampled token first, then the top-k; None if unasked.
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    sampled_ranks: torch.Tensor | None  # [B]


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        # Logprobs are those of the model's raw distribution (vLLM's default),
        # before penalties and temperature.
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        logits = self._process(logits, md)
        sampled = self._sample(logits, md)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return SamplerOutput(sampled, *self._gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs))

    @staticmethod
    def _process(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        # The grammar first: penalties, temperature and the filters then act
        # on the allowed tokens only.
        if md.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, md.grammar_bitmask)
        if md.min_tokens_mask is not None:
            banned = logits.masked_fill(md.min_tokens_mask, float("-inf"))
            if md.grammar_bitmask is not None:
                # A complete grammar allows only stop tokens: it wins over
                # min_tokens rather than leave a row with nothing to sample.
                empty = torch.isneginf(banned).all(dim=-1, keepdim=True)
                banned = torch.where(empty, logits, banned)
            logits = banned
        if md.repetition_penalty is not None:
            logits = apply_penalties(
                logits, md.prompt_token_mask, md.output_token_ids,
                md.presence_penalty, md.frequency_penalty, md.repetition_penalty,
            )
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1) if not md.all_random else None
        if md.all_greedy:
            return greedy
        # Greedy rows are sampled too here; their sample is discarded below.
        logits = apply_temperature_and_truncation(logits, md.temperature, md.min_p, md.top_k, md.top_p)
        sampled = random_sample(logits.softmax(dim=-1), md.generators)
        if greedy is None:
            return sampled
        return torch.where(md.temperature > 0, sampled, greedy)

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int):
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
        ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
            ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
            lps = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            ids, lps = sampled.unsqueeze(1), sampled_lp
        return ids, lps, ranks
