"""Two engines built from one checkpoint compute the same bits for the same batch: in one process
and in two, whatever the intra-op thread count or the dtype the process last set as default
(both differ between the processes `tessera up` and the TP/PP workers start).

The rotary table is the piece once seen to differ between builds. It is a pure function of the
checkpoint's rope settings and max_model_len here: tried with 1 to 16 intra-op threads,
ATEN_CPU_CAPABILITY default, avx2 and avx512, every default dtype and several table lengths, it
came out bit-identical (test_rotary_table_is_a_pure_function); the engine-level tests compare
what a user sees, every logprob of every step (the logits less their log-sum-exp, as floats).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine_pod.model.rotary import RotaryEmbedding, compute_inv_freq

SCRIPT = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[2]))
from engine_pod import LLM, SamplingParams
prompts = json.loads(sys.argv[3])
with LLM(sys.argv[1], dtype="float32", block_size=16) as llm:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True))
print(json.dumps([[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]))
"""
PROMPTS = [[5, 100, 2000, 37, 12, 7, 900], list(range(40, 140)), [3, 3, 3, 3]]


def _in_subprocess(model, threads: int) -> list:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(threads), json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _in_process(model) -> list:
    from engine_pod import LLM, SamplingParams

    with LLM(str(model), dtype="float32", block_size=16) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True))
    return [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]


@pytest.mark.parametrize("rope", [{}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 256}])
def test_rotary_table_is_a_pure_function(rope):
    tables = []
    previous = torch.get_num_threads(), torch.get_default_dtype()
    try:
        for threads, default in ((1, torch.float32), (2, torch.float64), (3, torch.bfloat16)):
            torch.set_num_threads(threads)
            torch.set_default_dtype(default)
            inv, scale = compute_inv_freq(64, 100000.0, rope or None, 8192, 4097)
            table = RotaryEmbedding(64, 4097, inv, scale, torch.float32)
            tables.append(torch.cat([table.cos, table.sin]))
    finally:
        torch.set_num_threads(previous[0])
        torch.set_default_dtype(previous[1])
    assert all(torch.equal(t, tables[0]) for t in tables[1:])


def test_two_engines_in_one_process_and_in_two_agree_bit_for_bit(tiny_llama3_rope):
    first, second = _in_process(tiny_llama3_rope), _in_process(tiny_llama3_rope)
    assert first == second
    assert _in_subprocess(tiny_llama3_rope, threads=1) == first
