"""Stop conditions end to end: every one ends a request the way vLLM does
(max_tokens, EOS and ignore_eos, stop token ids, min_tokens, stop strings,
max_model_len).

Expectations come from a first (greedy or seeded) run of the same engine, or
from the definitions; no token lists are hard-coded.
"""

from __future__ import annotations

import pytest

from engine_pod import LLM, SamplingParams
from tests.engine_pod.sampling_helpers import (
    ENGINE_KW,
    EOS_IDS,
    EOS_PROMPTS,
    greedy_output,
    random_prompts,
    token_prompt,
)
from tests.engine_pod.sampling_helpers import llm, tok  # noqa: F401 (fixtures)


# -- stop conditions ---------------------------------------------------------------

def test_max_tokens_gives_length_and_exact_count(llm):
    for n in (1, 7):
        out = greedy_output(llm, token_prompt(random_prompts(11, [10])[0]), n)
        assert len(out.token_ids) == n
        assert out.finish_reason == "length"
        assert out.stop_reason is None


@pytest.mark.parametrize("prompt", EOS_PROMPTS, ids=["eos-prompt-a", "eos-prompt-b"])
def test_eos_stops_and_ignore_eos_goes_on(llm, prompt):
    out = greedy_output(llm, token_prompt(prompt), 8)
    assert out.token_ids and out.token_ids[-1] in EOS_IDS, f"premise: greedy on {prompt} should hit EOS"
    assert len(out.token_ids) < 8
    assert out.finish_reason == "stop"
    assert out.stop_reason is None  # vLLM: None for EOS
    eos_at = len(out.token_ids) - 1
    # EOS is a special token: skipped in the text.
    assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1])

    ignored = greedy_output(llm, token_prompt(prompt), 8, ignore_eos=True)
    assert len(ignored.token_ids) == 8
    assert ignored.finish_reason == "length"
    assert ignored.token_ids[: eos_at + 1] == out.token_ids  # same greedy path, EOS kept

    # min_tokens bans EOS until min_tokens tokens exist.
    held = greedy_output(llm, token_prompt(prompt), 8, min_tokens=eos_at + 3)
    assert len(held.token_ids) >= eos_at + 3
    assert not set(held.token_ids[: eos_at + 3]) & EOS_IDS
    if held.finish_reason == "stop":
        assert held.token_ids[-1] in EOS_IDS
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 8


def test_explicit_stop_token_id_stops_even_with_ignore_eos(llm):
    prompt = EOS_PROMPTS[0]
    eos = greedy_output(llm, token_prompt(prompt), 8).token_ids[-1]
    assert eos in EOS_IDS
    out = greedy_output(llm, token_prompt(prompt), 8, ignore_eos=True, stop_token_ids=[eos])
    assert out.token_ids[-1] == eos and len(out.token_ids) < 8
    assert out.finish_reason == "stop"
    assert out.stop_reason == eos  # an explicit stop token id is reported


def test_stop_token_ids(llm):
    (prompt,) = random_prompts(12, [20])
    full = greedy_output(llm, token_prompt(prompt), 24).token_ids
    assert len(full) == 24
    t = full[4]
    first = full.index(t)
    out = greedy_output(llm, token_prompt(prompt), 24, stop_token_ids=[t])
    assert out.token_ids == full[: first + 1]  # the stop token id stays in token_ids
    assert out.finish_reason == "stop"
    assert out.stop_reason == t


def test_min_tokens_keeps_going_past_a_stop_token(llm):
    (prompt,) = random_prompts(12, [20])
    full = greedy_output(llm, token_prompt(prompt), 24).token_ids
    t = full[4]
    first = full.index(t)
    min_tokens = first + 3
    out = greedy_output(llm, token_prompt(prompt), 24, stop_token_ids=[t], min_tokens=min_tokens)
    ids = out.token_ids
    assert len(ids) >= min_tokens
    assert ids[:first] == full[:first]  # nothing changes before the banned position
    assert t not in ids[:min_tokens]
    if out.finish_reason == "stop":
        assert ids[-1] == t and out.stop_reason == t and t not in ids[:-1]
    else:
        assert out.finish_reason == "length" and len(ids) == 24


def _clean_greedy(llm, tok, max_tokens=24):
    """A text prompt whose greedy output decodes to plain ASCII (so string
    positions are unambiguous) and its output."""
    for text in ("The weather today is", "Once upon a time", "def main():", "Hello, my name is", "In 1998 the"):
        out = greedy_output(llm, text, max_tokens)
        if out.text.isascii() and len(out.text) >= 30:
            return text, out
    pytest.fail("no candidate prompt gives an ASCII greedy output")


def _text_of(tok, prompt: str, ids: list[int]) -> str:
    prompt_ids = tok.encode(prompt)
    return tok.decode(prompt_ids + ids, skip_special_tokens=True)[len(tok.decode(prompt_ids)) :]


def _stop_string(tok, prompt: str, out, start: int = 6) -> tuple[str, int]:
    """A stop string made of the text of two output tokens from ``start`` on,
    occurring once in the greedy text; and how many output tokens complete it."""
    assert _text_of(tok, prompt, out.token_ids) == out.text
    for i in range(start, len(out.token_ids) - 2):
        s = tok.decode(out.token_ids[i : i + 2], skip_special_tokens=True)
        if len(s) >= 3 and out.text.count(s) == 1:
            j = next(j for j in range(1, len(out.token_ids) + 1) if s in _text_of(tok, prompt, out.token_ids[:j]))
            return s, j
    raise AssertionError("no usable stop string in the greedy output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm, tok, include):
    prompt, full = _clean_greedy(llm, tok)
    s, j = _stop_string(tok, prompt, full)
    cut = full.text.index(s)
    out = greedy_output(llm, prompt, 24, stop=[s], include_stop_str_in_output=include)
    assert out.finish_reason == "stop"
    assert out.stop_reason == s
    assert out.text == (full.text[: cut + len(s)] if include else full.text[:cut])
    if not include:
        assert s not in out.text
    # Generation ended at the token that completed the stop string.
    assert out.token_ids == full.token_ids[:j]
    assert j < len(full.token_ids)


def test_earliest_stop_string_wins_end_to_end(llm, tok):
    prompt, full = _clean_greedy(llm, tok)
    late, _ = _stop_string(tok, prompt, full)
    early = full.text[1:4]
    assert full.text.index(early) < full.text.index(late)
    out = greedy_output(llm, prompt, 24, stop=[late, early])
    assert out.stop_reason == early
    assert out.text == full.text[: full.text.index(early)]


def test_min_tokens_suppresses_stop_strings(llm, tok):
    prompt, full = _clean_greedy(llm, tok)
    s, j = _stop_string(tok, prompt, full)
    # The only occurrence completes with token j: min_tokens=j ignores it...
    out = greedy_output(llm, prompt, 24, stop=[s], min_tokens=j)
    assert out.finish_reason == "length"
    assert out.token_ids == full.token_ids
    assert out.text == full.text
    # ... and min_tokens=j-1 does not.
    out = greedy_output(llm, prompt, 24, stop=[s], min_tokens=j - 1)
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == full.token_ids[:j]


def test_max_model_len_caps_output(tiny_llama):
    llm = LLM(str(tiny_llama), **{**ENGINE_KW, "max_model_len": 64, "kv_cache_memory_bytes": 8 << 20})
    lengths = [30, 50, 60, 63, 64]
    prompts = random_prompts(13, lengths)
    outs = llm.generate(
        [token_prompt(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    )
    for n, out in zip(lengths, outs):
        c = out.outputs[0]
        # Finished once prompt + output reaches max_model_len (at least one token is sampled).
        assert len(c.token_ids) == max(1, min(32, 64 - n)), n
        assert c.finish_reason == "length"
    # Without max_tokens, max_model_len alone ends the request.
    out = llm.generate(token_prompt(prompts[1]), SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 64 - 50
    assert out[0].outputs[0].finish_reason == "length"
