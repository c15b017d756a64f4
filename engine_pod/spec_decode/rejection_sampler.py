"""Verification of draft tokens against the target model's logits.

Each request with d drafts brings d + 1 logits rows: row j is the target
distribution p_j of the token after draft j (row 0: after the last verified
token). Drafts are accepted left to right; the first rejected one is replaced
and the rest are dropped; when all d survive, row d gives a bonus token.

- Greedy rows: accept while the draft equals argmax p_j; at the first
  mismatch emit argmax p_j. The output is exactly what greedy decoding emits.
- Sampling rows: speculative sampling with a point-mass draft (q(x) = 1):
  accept x with probability min(1, p(x) / q(x)) = p(x); on rejection draw
  from max(0, p - q) normalised, which is p with x removed and renormalised.
  Each emitted token is then distributed as p exactly. p is the processed
  distribution (temperature, min-p, top-k / top-p), as the sampler's.
"""

from __future__ import annotations

import torch

from engine_pod.sample.metadata import SamplingMetadata
from engine_pod.sample.ops import apply_grammar_bitmask, apply_temperature_and_truncation, random_sample

# Fill of the output beyond each request's emitted tokens.
PAD = -1


class RejectionSampler:
    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata, draft_token_ids: list[list[int]]
    ) -> torch.Tensor:
        """``logits`` [sum(d + 1), V] and ``md`` hold each request's rows in
        order; returns [requests, max d + 1] emitted tokens, PAD-filled."""
        dev = logits.device
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if md.grammar_bitmask is not None:
            # Row j's target is the grammar's distribution after drafts[:j]
            # (the scheduler cut the drafts to what the grammar accepts).
            logits = apply_grammar_bitmask(logits, md.grammar_bitmask)
        num_drafts = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64, device=dev)
        row_starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
        # Per row, the draft it verifies; PAD on each request's bonus row.
        row_drafts = torch.tensor(
            [t for d in draft_token_ids for t in (*d, PAD)], dtype=torch.int64, device=dev
        )
        accepted, emitted = self._verify_rows(logits, md, row_drafts)
        return self._assemble(accepted, emitted, row_drafts, row_starts, num_drafts)

    @staticmethod
    def _verify_rows(logits: torch.Tensor, md: SamplingMetadata, row_drafts: torch.Tensor):
        """Per row: is its draft accepted, and the token to emit if the
        request stops there (the replacement, or the bonus on bonus rows)."""
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy == row_drafts, greedy
        probs = apply_temperature_and_truncation(logits, md.temperature, md.min_p, md.top_k, md.top_p).softmax(-1)
        has_draft = row_drafts >= 0
        draft = row_drafts.clamp(min=0).unsqueeze(1)
        p_draft = probs.gather(1, draft).squeeze(1)
        uniform = torch.rand(len(probs), dtype=probs.dtype, device=probs.device)
        for row, generator in md.generators.items():
            uniform[row] = torch.rand((), dtype=probs.dtype, device=probs.device, generator=generator)
        residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, draft, 0.0), probs)
        # Rounding can leave p(x) a hair under 1 with nothing else to draw:
        # the exact rule never rejects such a draft.
        nothing_else = residual.sum(dim=-1) <= 0
        accept_random = has_draft & ((uniform < p_draft) | nothing_else)
        emit_random = random_sample(residual, md.generators)
        is_greedy = md.temperature <= 0
        return (
            torch.where(is_greedy, greedy == row_drafts, accept_random),
            torch.where(is_greedy, greedy, emit_random),
        )

    @staticmethod
    def _assemble(accepted, emitted, row_drafts, row_starts, num_drafts) -> torch.Tensor:
        max_drafts = int(num_drafts.max())
        pos = torch.arange(max_drafts + 1, device=row_drafts.device)
        # Rows of each request, padded by repeating its bonus row.
        rows = row_starts.unsqueeze(1) + torch.minimum(pos.unsqueeze(0), num_drafts.unsqueeze(1))
        draft_rows = rows[:, :max_drafts]
        ok = accepted[draft_rows] & (pos[:max_drafts].unsqueeze(0) < num_drafts.unsqueeze(1))
        num_accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
        out = torch.full_like(rows, PAD)
        keep = pos[:max_drafts].unsqueeze(0) < num_accepted.unsqueeze(1)
        out[:, :max_drafts] = torch.where(keep, row_drafts[draft_rows], PAD)
        out.scatter_(1, num_accepted.unsqueeze(1), emitted[row_starts + num_accepted].unsqueeze(1))
        return out
