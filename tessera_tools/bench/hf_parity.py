"""Greedy parity with Hugging Face, teacher-forced: where the engine's greedy tokens part from
HF's choices, with both top-2 margins (the tests' and `tessera bench quality`'s one home)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Divergence:
    """A position where the engine's greedy token is not HF's, with both top-2 logit margins."""

    prompt: int
    position: int
    engine_token: int
    hf_token: int
    hf_margin: float
    """HF's logit of its top token minus that of its second."""
    engine_margin: float | None
    """The engine's logprob of its top token minus that of its second (the same as the logits'
    difference), when it reported two."""


def _teacher_forced_batch(model, prompts: list[list[int]], generated: list[list[int]]):
    # Right-padded, so every real position sees exactly its own causal prefix.
    seqs = [p + g[:-1] for p, g in zip(prompts, generated)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.double()
    out = []
    for row, (p, g) in zip(logits, zip(prompts, generated)):
        top2 = row[len(p) - 1: len(p) - 1 + len(g)].topk(2, dim=-1)
        out.append((top2.indices[:, 0].tolist(), (top2.values[:, 0] - top2.values[:, 1]).tolist()))
    return out


def greedy_divergences(model, prompts: list[list[int]], outputs, batch: int = 16) -> list[Divergence]:
    """HF's greedy choice at each generated position given the engine's own earlier tokens (one
    forward over prompt + generated): where every choice equals the engine's token, HF's own
    greedy generation is that same sequence, by induction. Returns the first position where each
    engine output (run greedy, logprobs>=2 for the engine's margin) parts from HF's choice; HF
    runs `batch` sequences per forward."""
    found = []
    generated = [out.outputs[0].token_ids for out in outputs]
    hf = [r for s in range(0, len(prompts), batch)
          for r in _teacher_forced_batch(model, prompts[s:s + batch], generated[s:s + batch])]
    for i, (out, (choices, margins)) in enumerate(zip(outputs, hf)):
        completion = out.outputs[0]
        for j, (got, want) in enumerate(zip(completion.token_ids, choices)):
            if got != want:
                step = completion.logprobs[j] if completion.logprobs else None
                top = sorted((lp.logprob for lp in step.values()), reverse=True) if step else []
                found.append(Divergence(i, j, got, want, margins[j], top[0] - top[1] if len(top) > 1 else None))
                break  # past the first, the contexts differ
    return found
