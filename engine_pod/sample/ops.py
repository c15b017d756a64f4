"""Logit processors: grammar bitmask, penalties, min-p, top-k / top-p, random sampling."""

from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens a row's grammar forbids to -inf. ``bitmask``
    is [rows, ceil(vocab / 32)] int32: bit j of word w allows token 32w + j."""
    num_rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(num_rows, -1)[:, :vocab]
    # Adding -inf or 0 per bit (x + 0 is exactly x) measured 2x faster on
    # CPU than masked_fill with the bool mask.
    offsets = torch.tensor([float("-inf"), 0.0], dtype=logits.dtype, device=logits.device)
    return logits + torch.take(offsets, bits.long())


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM semantics: repetition penalty over prompt and output tokens
    (divide positive logits, multiply negative ones); frequency and presence
    penalties over output tokens only (subtract count * f and [count>0] * p)."""
    num_rows, vocab = logits.shape
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.int64, device=logits.device)
    counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids))
    counts = counts[:, :vocab]  # column `vocab` collects padding
    seen = prompt_mask | (counts > 0)
    rep = repetition.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * counts
    logits = logits - presence.unsqueeze(1) * (counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose probability
    reaches p (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1).long())
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        drop = cumulative <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_temperature_and_truncation(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """The distribution random sampling draws from, as logits: temperature,
    then min-p, then top-k / top-p. Rows with temperature 0 (greedy) are
    scaled by 1; their caller takes the argmax of the raw logits instead."""
    temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits / temperature.unsqueeze(1)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row by the exponential race (argmax p / E with
    E ~ Exp(1)), which needs no cumsum or host sync. Seeded rows draw their
    noise from their own generator, so their samples do not depend on what
    else is in the batch."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return probs.div(noise).argmax(dim=-1)
