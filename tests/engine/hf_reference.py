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
