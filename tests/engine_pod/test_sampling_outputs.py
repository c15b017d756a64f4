"""What a finished request reports end to end: its text (special tokens,
a prompt cut inside a character) and its logprobs.

Expectations come from a first (greedy or seeded) run of the same engine, or
from the definitions; no token lists are hard-coded.
"""

from __future__ import annotations

import math

import pytest

from engine_pod import SamplingParams
from tests.engine_pod.sampling_helpers import (
    greedy_output,
    random_prompts,
    token_prompt,
)
from tests.engine_pod.sampling_helpers import llm, tok  # noqa: F401 (fixtures)


# -- output text -------------------------------------------------------------------

def test_text_with_and_without_special_tokens(llm, tok):
    prompt = "Once upon a time"
    prompt_ids = tok.encode(prompt)
    plain = greedy_output(llm, prompt, 16)
    special = greedy_output(llm, prompt, 16, skip_special_tokens=False)
    assert special.token_ids == plain.token_ids
    for out, skip in ((plain, True), (special, False)):
        full = tok.decode(prompt_ids + out.token_ids, skip_special_tokens=skip)
        assert out.text == full[len(tok.decode(prompt_ids)) :]
    # The model emits reserved (special) tokens here, so the two texts differ.
    assert any(t >= 6065 for t in plain.token_ids)
    assert "<|reserved_" in special.text and "<|reserved_" not in plain.text


def test_output_text_does_not_repeat_a_prompt_cut_inside_a_character(llm, tok):
    ids = tok.encode("The quick naïve")
    k = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt_ids = ids[:k]
    out = greedy_output(llm, token_prompt(prompt_ids), 8)
    full = tok.decode(prompt_ids + out.token_ids, skip_special_tokens=True)
    prompt_text = tok.decode(prompt_ids).rstrip("\ufffd")  # "The quick na"
    assert full.startswith(prompt_text)
    assert full.endswith(out.text)
    # At most the complete characters of the last prompt token (held back
    # while its text ended mid-character) may precede the new text; never
    # the rest of the prompt.
    held_back = tok.decode(prompt_ids[-1:]).rstrip("\ufffd")
    assert len(out.text) <= len(full) - len(prompt_text) + len(held_back)


# -- logprobs ----------------------------------------------------------------------

def test_greedy_logprobs(llm, tok):
    (prompt,) = random_prompts(14, [25])
    k = 5
    c = greedy_output(llm, token_prompt(prompt), 10, logprobs=k)
    assert len(c.logprobs) == len(c.token_ids) == 10
    for token, step in zip(c.token_ids, c.logprobs):
        assert token in step
        assert step[token].rank == 1  # greedy picks the top token
        assert len(step) == k  # the sampled token is one of the top-k
        ranked = sorted(step.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == list(range(1, k + 1))
        values = [lp.logprob for lp in ranked]
        assert all(v <= 0 for v in values)
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-9
        for tid, lp in step.items():
            assert lp.decoded_token == tok.decode([tid], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(c.token_ids, c.logprobs)))


def test_sampled_logprobs_ranks(llm):
    (prompt,) = random_prompts(15, [25])
    k = 2
    c = llm.generate(
        token_prompt(prompt), SamplingParams(temperature=1.5, seed=1, max_tokens=24, logprobs=k)
    )[0].outputs[0]
    outside = 0
    for token, step in zip(c.token_ids, c.logprobs):
        entry = step[token]
        top = [lp for lp in step.values() if lp.rank <= k]
        assert sorted(lp.rank for lp in top) == list(range(1, k + 1))
        if entry.rank > k:
            outside += 1
            assert len(step) == k + 1  # the sampled token plus the top k
            assert all(entry.logprob <= lp.logprob for lp in top)
        else:
            assert len(step) == k
        assert entry.logprob <= 0
    assert outside > 0  # at temperature 1.5 some samples fall outside the top 2


def test_logprobs_are_of_the_raw_distribution(llm):
    (prompt,) = random_prompts(16, [18])
    greedy = greedy_output(llm, token_prompt(prompt), 1, logprobs=20).logprobs[0]
    hot = llm.generate(
        token_prompt(prompt),
        SamplingParams(temperature=0.5, seed=2, max_tokens=1, logprobs=20, repetition_penalty=1.5, top_k=5),
    )[0].outputs[0].logprobs[0]
    top_greedy = {t: lp.logprob for t, lp in greedy.items() if lp.rank <= 20}
    top_hot = {t: lp.logprob for t, lp in hot.items() if lp.rank <= 20}
    assert top_hot.keys() == top_greedy.keys()
    for t in top_greedy:
        assert top_hot[t] == pytest.approx(top_greedy[t], abs=1e-9)


def test_logprobs_zero_and_none(llm):
    (prompt,) = random_prompts(17, [8])
    c = greedy_output(llm, token_prompt(prompt), 4, logprobs=0)
    assert [list(step) for step in c.logprobs] == [[t] for t in c.token_ids]
    assert all(step[t].rank == 1 for t, step in zip(c.token_ids, c.logprobs))
    c = greedy_output(llm, token_prompt(prompt), 4)
    assert c.logprobs is None and c.cumulative_logprob is None
