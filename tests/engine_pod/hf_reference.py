"""Hugging Face Transformers as the oracle: greedy tokens and their logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


@dataclass
class HFResult:
    token_ids: list[int]
    logprobs: list[float]


def hf_greedy(model_path: Path, prompts: list[list[int]], max_tokens: list[int], dtype=torch.float64) -> list[HFResult]:
    """One prompt at a time (no padding), greedy, stopping at the generation
    config's EOS ids like the engine does."""
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    model.eval()
    gen_cfg = GenerationConfig.from_pretrained(str(model_path))
    results = []
    with torch.no_grad():
        for ids, n in zip(prompts, max_tokens):
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=gen_cfg.eos_token_id,
                pad_token_id=gen_cfg.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = out.sequences[0, len(ids):].tolist()
            logprobs = [
                torch.log_softmax(step[0].double(), dim=-1)[tok].item() for step, tok in zip(out.logits, new)
            ]
            results.append(HFResult(new, logprobs))
    return results


def assert_matches_hf(outputs, reference: list[HFResult], prompts: list[list[int]], logprob_tol: float) -> None:
    """Engine outputs (with logprobs=0) equal HF's tokens, and their chosen-token
    logprobs are within ``logprob_tol`` of HF's."""
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        got = out.outputs[0].token_ids
        assert got == ref.token_ids, f"prompt {i} (len {len(prompts[i])}): {got} != HF {ref.token_ids}"
        lps = [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]
        for j, (a, b) in enumerate(zip(lps, ref.logprobs)):
            assert abs(a - b) < logprob_tol, f"prompt {i} token {j}: logprob {a} vs HF {b}"


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
    """The engine's logprob of its top token minus that of its second, when it reported two."""


def hf_teacher_forced(model, prompt: list[int], generated: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy choice at each generated position given the engine's own earlier tokens (one
    forward over prompt + generated), and its top-2 logit margin there. Where every choice
    equals the engine's token, HF's own greedy generation is that same sequence, by induction."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:].double()
    top2 = logits.topk(2, dim=-1)
    return top2.indices[:, 0].tolist(), (top2.values[:, 0] - top2.values[:, 1]).tolist()


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
    """Every position where an engine output (run greedy, logprobs>=2 for the engine's margins)
    parts from HF's choice; HF runs `batch` sequences per forward."""
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
