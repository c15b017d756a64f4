"""SamplingParams.prompt_logprobs: each prompt token's logprob given the tokens before it, as
Hugging Face computes it, whatever the engine does meanwhile (chunked prefill, a warm prefix
cache it must not read from, preemption and recompute)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_pod import LLM, SamplingParams

PROMPTS = [list(range(10, 70)), [5, 100, 2000, 37, 12, 7, 900, 33, 44], [42]]
SETTINGS = {
    "one chunk": {},
    "chunked prefill, budget 16": {"max_num_batched_tokens": 16},
    "preemption": {"num_gpu_blocks": 6, "kv_cache_memory_bytes": None, "max_model_len": 96},
}


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0], -1)
            out.append((lp, [lp[i, p[i + 1]].item() for i in range(len(p) - 1)]))
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prompt_logprobs_equal_hugging_face(setting, tiny_llama, hf_logprobs):
    with LLM(str(tiny_llama), dtype="float32", block_size=16, **SETTINGS[setting]) as llm:
        # The same prompts once before: the prefix cache holds them, and must not be read.
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=1))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=2, ignore_eos=True))
        if setting == "preemption":
            assert llm.stats.num_preemptions > 0
    for prompt, out, (hf_all, hf_chosen) in zip(PROMPTS, outs, hf_logprobs):
        assert out.num_cached_tokens == 0
        steps = out.prompt_logprobs
        assert len(steps) == len(prompt) and steps[0] is None
        for i, step in enumerate(steps[1:]):
            token = prompt[i + 1]
            assert abs(step[token].logprob - hf_chosen[i]) < 1e-4, (i, step[token].logprob, hf_chosen[i])
            assert step[token].rank == int((hf_all[i] > hf_all[i, token]).sum()) + 1
            assert {t for t, lp in step.items() if lp.rank <= 2} == set(hf_all[i].topk(2).indices.tolist())


def test_without_prompt_logprobs_there_are_none(tiny_llama):
    with LLM(str(tiny_llama), dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=2))[0]
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
