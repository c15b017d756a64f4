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

